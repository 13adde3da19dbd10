"""fmtkit inside qwix: a quantization provider that runs fmtkit's FP8/FP4 recipes under
``qwix.quantize_model``, and converters between ``fmtkit.ScaledArray`` and ``qwix.QArray``.

Needs the optional dependency qwix (``pip install fmtkit[qwix]``; written against qwix
0.1.8). ``import fmtkit`` never imports this module, nor qwix.

**Provider.** ``FmtkitProvider(rules)`` is a ``qwix.QtProvider`` whose rules may be
``FmtkitRule``s: a qwix rule (``module_path`` regex, ``op_names``; the first rule whose
``module_path`` fully matches decides, as in qwix) that names an fmtkit recipe instead of
qwix qtypes. Under ``qwix.quantize_model(model, provider)`` (linen or NNX), every
``jax.lax.dot_general``, ``jax.numpy.einsum`` and ``jax.lax.ragged_dot`` the model runs
inside a module that such a rule matches runs through ``fmtkit.fp8``:

* ``dot_general`` / ``einsum`` with one parameter operand: ``fmtkit.fp8.dot_general_fn``
  (forward, data-gradient and weight-gradient GEMMs on FP8 or FP4 operands). The weight is
  recognised on either side (``qwix``'s own parameter lookup, the one its QT provider
  uses); a weight on the left is swapped to the right, so it gets the recipe's weight
  tiling (128x128 for "blockwise"), and the output transposed back.
* ``ragged_dot`` (an MoE layer's experts): ``fmtkit.fp8.ragged_dot``, the grouped FP8 GEMM
  with one scale (or one set of 128x128 blocks) per expert.

Left as the model wrote them: modules no rule matches, products of two activations
(attention's ``q·k``) or of two parameters, a ``precision`` above DEFAULT (HIGH, HIGHEST,
an algorithm), einsums of more than two operands and convolutions. Plain ``qwix.QtRule``s
in the same provider keep qwix's own quantized training.

Refused with an error, never run silently in higher precision: a delayed-scaling recipe
(its amax history is state that a training step must thread; qwix gives interceptors no
place for it: use ``fmtkit.with_policy``, whose linen / NNX adapters keep the history in
an ``fp8_state`` collection), an FP4 recipe on ``ragged_dot`` and a ``ragged_dot`` with
``group_offset`` (fmtkit's grouped GEMM has neither).

``fmtkit.debug`` statistics are not available under the provider: they come from the GEMM
hook of ``fmtkit.with_policy``, which never sees GEMMs that qwix's interception replaced
(run the model under ``with_policy`` with the same recipe to read them).

**Converters.** ``to_qarray(sa)`` and ``from_qarray(qa)`` move quantized tensors between
the two libraries with the same convention, ``x ≈ values * scale`` with the scale broadcast
per tile (qwix: ``qvalue * scale``; the tile is ``qvalue.shape // scale.shape``), so the
values are never touched and ``qwix.dequantize(to_qarray(sa))`` equals
``fmtkit.dequantize(sa)`` bit for bit. What is lossy and refused (``ValueError``): scales
narrower than f32 on the way to qwix (``QArray.scale`` also sets the dtype qwix
dequantizes to; cast the result instead), asymmetric qwix arrays (a ``zero_point``),
integer or FP6 values (formats the other side has no name for) and, on the way back, qwix
MX scales that are not powers of two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from jax import lax
from qwix._src.utils import flax_util

from fmtkit import fp8
from fmtkit.formats import get_format
from fmtkit.scaling import AxisScaling, BlockScaling, MXScaling, ScaledArray, TensorScaling

__all__ = ["FmtkitProvider", "FmtkitRule", "from_qarray", "to_qarray"]

# qwix's names for the MX element types (qwix 0.1.8, ``qwix._src.core.numerics``): "mxfp8"
# is E4M3 and "mxfp4" E2M1, both in tiles of 32 with power-of-two scales (OCP MX v1.0).
_MX_QTYPES = {"mxfp8": "float8_e4m3fn", "mxfp4": "float4_e2m1fn"}
_MX_BLOCK = 32


# ---------------------------------------------------------------------------------------
# Converters


def to_qarray(sa: ScaledArray) -> qwix.QArray:
    """The ``qwix.QArray`` holding the same values and scales as ``sa``, losslessly.

    ``qvalue`` is ``sa.values`` (the same FP8/FP4 array), ``scale`` is ``sa.scale`` in f32
    (an MX array's E8M0 scales widened exactly; f32 is also the dtype ``qwix.dequantize``
    returns), and ``qtype`` is qwix's "mxfp8" / "mxfp4" for OCP MX arrays (E4M3 / E2M1
    values, blocks of 32), else the values' dtype. Every fmtkit tiling converts: per tensor
    (``TensorScaling``, ``DelayedScaling``), per axis, any ``BlockScaling`` (1x128,
    128x128), ``MXScaling``; the recipe is not kept (qwix has no field for it:
    ``from_qarray(qa, recipe=...)`` restores it).

    Args:
      sa: a ``fmtkit.ScaledArray``.

    Returns:
      ``qwix.QArray(qvalue, scale, None, qtype)`` with
      ``qwix.dequantize(result) == fmtkit.dequantize(sa)`` bit for bit.

    Raises:
      TypeError: ``sa`` is not a ``ScaledArray`` (an ``fmtkit.fp4.Fp4Array``'s two-level
        scales have no exact one-scale-per-tile form).
      ValueError: FP6 values (qwix has no FP6 type; fmtkit stores them in an E4M3
        container).

    Example:
      >>> import fmtkit
      >>> sa = fmtkit.quantize(jnp.ones((4, 256)), "e4m3", fmtkit.BlockScaling((1, 128)))
      >>> to_qarray(sa).scale.shape
      (4, 2)
    """
    if hasattr(sa, "tensor_scale") and hasattr(sa, "block_scale"):
        raise TypeError("sa is an fmtkit.fp4.Fp4Array: its two-level scales (block scale x "
                        "f32 tensor scale) have no exact single f32 scale per tile, which is "
                        "all a QArray holds; quantize with fmtkit.quantize(x, 'fp4', "
                        "MXScaling(32)) for an MXFP4 QArray.")
    if not isinstance(sa, ScaledArray):
        raise TypeError(f"sa must be a fmtkit.ScaledArray, got {type(sa).__name__}.")
    if sa.fmt.bits == 6:
        raise ValueError(f"sa.fmt={sa.fmt.name}: qwix has no FP6 type (fmtkit keeps FP6 "
                         "values in an E4M3 container); quantize to e4m3, e5m2 or e2m1.")
    qtype: Any = sa.values.dtype
    if isinstance(sa.recipe, MXScaling) and sa.recipe.block == _MX_BLOCK:
        qtype = next((q for q, d in _MX_QTYPES.items() if d == sa.fmt.name), qtype)
    return qwix.QArray(sa.values, sa.scale.astype(jnp.float32), None, qtype)


def _infer_recipe(shape: tuple[int, ...], tile: tuple[int, ...], qtype: Any) -> Any:
    """The fmtkit recipe whose blocks are ``tile`` on an array of ``shape``."""
    if isinstance(qtype, str):
        tiled = [i for i, (n, t) in enumerate(zip(shape, tile)) if t != 1]
        if len(tiled) != 1 or tile[tiled[0]] != _MX_BLOCK:
            raise ValueError(f"qa: a {qtype} array needs tiles of {_MX_BLOCK} along one axis, "
                             f"got tile {tile} for shape {shape}.")
        return MXScaling(block=_MX_BLOCK, scale_rounding="rceil", axis=tiled[0])
    if tile == shape:
        return TensorScaling()
    full = tuple(i for i, (n, t) in enumerate(zip(shape, tile)) if t == n and n != 1)
    if all(t in (1, n) for n, t in zip(shape, tile)) and full:
        return AxisScaling(full if len(full) > 1 else full[0])
    return BlockScaling(tile)


def from_qarray(qa: qwix.QArray, *, recipe: Any = None) -> ScaledArray:
    """The ``fmtkit.ScaledArray`` holding the same values and scales as ``qa``, losslessly.

    ``values`` is ``qa.qvalue``, ``scale`` is ``qa.scale`` in f32 (bf16 / f16 scales widen
    exactly), or E8M0 for qwix's "mxfp8" / "mxfp4" arrays. The recipe (static metadata; no
    number depends on it) is ``recipe`` when given, else the one whose blocks are qwix's
    tiles: ``TensorScaling`` (one scale), ``AxisScaling`` (a scale per slice), ``MXScaling(
    32, "rceil")`` for MX (qwix 0.1.8's rule, ``2^ceil(log2(amax / max))``) or
    ``BlockScaling(tile)``.

    Args:
      qa: a symmetric ``qwix.QArray`` with FP8 or FP4 values.
      recipe: the fmtkit recipe to record (e.g. the ``DelayedScaling`` that produced the
        array before ``to_qarray``); its blocks must be the array's tiles.

    Returns:
      A ``ScaledArray`` with ``fmtkit.dequantize(result) == qwix.dequantize(qa)`` in f32
      (``qa.scale.dtype`` is qwix's output dtype: cast fmtkit's result to it).

    Raises:
      TypeError: ``qa`` is not a ``QArray``, or its values are not a floating format
        of ``fmtkit.FORMATS`` (int8, int4, nf4: qwix's integer types).
      ValueError: a ``zero_point`` (asymmetric quantization has no fmtkit equivalent), MX
        scales that are not powers of two (concrete arrays only: under ``jit`` they are
        assumed to be, as qwix computes them), or a ``recipe`` whose blocks differ.

    Example:
      >>> import qwix
      >>> qa = qwix.quantize(jnp.ones((4, 256)), jnp.float8_e4m3fn, channelwise_axes=(0,),
      ...                    tiled_axes={1: 128})
      >>> from_qarray(qa).recipe
      BlockScaling(block=(1, 128), power_of_two=False, margin=0)
    """
    if not isinstance(qa, qwix.QArray):
        raise TypeError(f"qa must be a qwix.QArray, got {type(qa).__name__}.")
    if qa.zero_point is not None:
        raise ValueError("qa has a zero_point (asymmetric quantization): fmtkit's scaled "
                         "arrays are symmetric (x ≈ values * scale); quantize with "
                         "calibration_method='absmax'.")
    qtype = qa.qtype if isinstance(qa.qtype, str) else jnp.dtype(qa.qtype).name
    if isinstance(qtype, str) and qtype in _MX_QTYPES:
        fmt_name = _MX_QTYPES[qtype]
    elif qtype in _MX_QTYPES.values() or qtype in ("float8_e5m2",):
        fmt_name, qtype = qtype, None
    else:
        raise TypeError(f"qa.qtype={qa.qtype!r}: fmtkit converts FP8 and FP4 arrays "
                        "(float8_e4m3fn, float8_e5m2, float4_e2m1fn, mxfp8, mxfp4).")
    fmt = get_format(fmt_name)
    if qa.qvalue.dtype != fmt.dtype:
        raise TypeError(f"qa.qvalue has dtype {qa.qvalue.dtype}; qtype {qa.qtype!r} stores "
                        f"{fmt.dtype.name}.")
    shape = tuple(qa.qvalue.shape)
    tile = tuple(qa.scale_tile_shape)
    inferred = _infer_recipe(shape, tile, qtype)
    if recipe is None:
        recipe = inferred
    elif tuple(max(b, 1) for b in recipe.block_shape(shape)) != tile:
        raise ValueError(f"recipe={recipe!r} has blocks {recipe.block_shape(shape)} on shape "
                         f"{shape}; qa's tiles are {tile}.")
    scale = qa.scale.astype(jnp.float32)
    if isinstance(recipe, MXScaling):
        scale = _to_e8m0(scale)
    return ScaledArray(qa.qvalue, scale, fmt, recipe)


def _to_e8m0(scale: jax.Array) -> jax.Array:
    """f32 power-of-two scales as E8M0 (NaN stays NaN); ValueError when a concrete scale is
    not a power of two in E8M0's range [2^-127, 2^127] (the conversion would round)."""
    if not isinstance(scale, jax.core.Tracer):
        s = jnp.asarray(scale)
        m, e = jnp.frexp(s)
        bad = jnp.isfinite(s) & ((m != 0.5) | (e - 1 < -127) | (e - 1 > 127))
        if bool(jnp.any(bad)):
            raise ValueError("qa.scale holds values that are not powers of two in "
                             "[2^-127, 2^127]: they have no exact E8M0 form; pass "
                             "recipe=BlockScaling(...) to keep them in f32.")
    return scale.astype(jnp.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------
# Provider


@dataclasses.dataclass(frozen=True, kw_only=True)
class FmtkitRule(qwix.QtRule):
    """A qwix rule that runs the matched GEMMs with an fmtkit recipe.

    Matched like every qwix rule (``module_path``: a regex that must fully match the
    module path, "/"-joined, e.g. ``"decoder/layers/mlp/.*"``; ``op_names``: a subset of
    "dot_general", "einsum", "ragged_dot", or all when empty). The qwix quantization fields
    (``weight_qtype``, ``act_qtype``, ``bwd_qtype``, ``tile_size``, ...) must stay unset:
    fmtkit's recipe decides formats, tilings and all three GEMMs.

    Attributes:
      recipe: a name of ``fmtkit.fp8.RECIPES`` or ``fmtkit.fp4.RECIPES`` ("current",
        "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4") or an ``fmtkit.fp8.Fp8Recipe``;
        None matches the module and leaves its GEMMs as written (a way to exempt a module
        ahead of a broader rule). Delayed recipes raise: see the module docstring.

    Example:
      >>> FmtkitRule(module_path=".*mlp.*", recipe="blockwise").recipe.name
      'blockwise'
    """

    recipe: Any = None

    def __post_init__(self):
        if self.recipe is not None:
            recipe = fp8.get_recipe(self.recipe)
            if recipe.delayed:
                raise ValueError(
                    f"FmtkitRule(recipe={recipe.name!r}): delayed scaling keeps an amax "
                    "history that the training step must thread, and qwix's interceptors "
                    "have no place for it. Use a current recipe here ('current' has the "
                    "same formats), or fmtkit.with_policy(model, rules), whose linen / NNX "
                    "adapters keep the history in the 'fp8_state' collection.")
            object.__setattr__(self, "recipe", recipe)
        set_fields = [f for f in ("weight_qtype", "act_qtype", "bwd_qtype", "tile_size",
                                  "bwd_weight_grad_tile_size", "bwd_stochastic_rounding",
                                  "additional_qt_config", "act_static_scale")
                      if getattr(self, f) not in (None, False)]
        if set_fields:
            raise ValueError(f"FmtkitRule: {', '.join(set_fields)} must be unset; the fmtkit "
                             "recipe decides the formats and tilings (use a qwix.QtRule for "
                             "qwix's own quantization).")


def _is_default(precision: Any) -> bool:
    """Whether ``precision`` asks for nothing above an FP8 GEMM (None / DEFAULT, or a pair)."""
    ps = precision if isinstance(precision, tuple | list) else (precision,)
    return all(p is None or p == lax.Precision.DEFAULT or p == "DEFAULT" for p in ps)


def _is_param(x: Any) -> bool:
    """Whether ``x`` is (a view of) a parameter of the current module, by qwix's own lookup
    (``flax_util.find_param``, the one its QT provider uses to tell weights from
    activations: the array itself, a unary op of it under ``jit``, or a shape match)."""
    return flax_util.find_param(x) is not None


def _swapped(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (rc, lc), (rb, lb)


class FmtkitProvider(qwix.QtProvider):
    """A ``qwix.QtProvider`` that runs the GEMMs its ``FmtkitRule``s match through
    ``fmtkit.fp8`` (see the module docstring for what runs where).

    Args:
      rules: ``FmtkitRule``s and plain ``qwix.QtRule``s, in order of precedence (the first
        whose ``module_path`` fully matches the module, and whose ``op_names`` contain the
        op, decides).
      disable_jit: as for ``qwix.QtProvider``.

    Example:
      >>> import flax.linen as nn, qwix
      >>> provider = FmtkitProvider([FmtkitRule(module_path=".*", recipe="current")])
      >>> model = qwix.quantize_model(nn.Dense(16), provider)
      >>> params = model.init(jax.random.key(0), jnp.ones((4, 32)))
      >>> model.apply(params, jnp.ones((4, 32))).shape
      (4, 16)
    """

    def __init__(self, rules, *, disable_jit: bool = False):
        super().__init__(rules, disable_jit=disable_jit)

    def _recipe(self, op_name: str) -> fp8.Fp8Recipe | None:
        """The recipe of the rule that decides ``op_name`` here (None: not an FmtkitRule)."""
        rule, _ = self._get_current_rule_and_op_id(op_name, only_rule=True)
        return rule.recipe if isinstance(rule, FmtkitRule) else None

    def _fp8_dot(self, recipe, lhs, rhs, dimension_numbers, preferred_element_type,
                 out_sharding):
        """``fmtkit.fp8`` for a dot with a weight on one side; None if neither or both
        operands are weights (the caller then runs the dot as written)."""
        lhs_w, rhs_w = _is_param(lhs), _is_param(rhs)
        if lhs_w == rhs_w:
            return None
        name = "/".join(map(str, flax_util.get_current_module_path()))
        dot = fp8.dot_general_fn(recipe, name=name or None)
        if rhs_w:
            return dot(lhs, rhs, dimension_numbers,
                       preferred_element_type=preferred_element_type,
                       out_sharding=out_sharding)
        # The weight on the left: compute x · w with the weight as fmtkit's right operand,
        # then move the weight's free dims back in front of the activation's.
        (lc, rc), (lb, _) = dimension_numbers
        nb = len(lb)
        n_wfree = lhs.ndim - len(lc) - nb
        n_xfree = rhs.ndim - len(rc) - nb
        y = dot(rhs, lhs, _swapped(dimension_numbers),
                preferred_element_type=preferred_element_type)
        perm = (*range(nb), *range(nb + n_xfree, nb + n_xfree + n_wfree),
                *range(nb, nb + n_xfree))
        y = y.transpose(perm)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, *, out_sharding=None):
        """``jax.lax.dot_general`` under the provider."""
        recipe = self._recipe("dot_general")
        if recipe is not None and _is_default(precision):
            y = self._fp8_dot(recipe, lhs, rhs, dimension_numbers, preferred_element_type,
                              out_sharding)
            if y is not None:
                return y
        return super().dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, out_sharding=out_sharding)

    def einsum(self, einsum_str, *operands, precision=None, preferred_element_type=None,
               _dot_general=jax.lax.dot_general, out_sharding=None):
        """``jax.numpy.einsum`` under the provider (two operands: its one dot_general)."""
        recipe = self._recipe("einsum")
        if recipe is None or not _is_default(precision) or len(operands) != 2:
            return super().einsum(einsum_str, *operands, precision=precision,
                                  preferred_element_type=preferred_element_type,
                                  _dot_general=_dot_general, out_sharding=out_sharding)

        def dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, **kwargs):
            y = self._fp8_dot(recipe, lhs, rhs, dimension_numbers, preferred_element_type,
                              kwargs.get("out_sharding"))
            if y is None:  # activation x activation: as written
                y = _dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type, **kwargs)
            return y

        # Without jit, einsum hands the operands themselves to dot_general, so the parameter
        # lookup can still recognise the weight (what qwix's QT provider does too).
        with jax.disable_jit():
            return jnp.einsum(einsum_str, *operands, precision=precision,
                              preferred_element_type=preferred_element_type,
                              _dot_general=dot_general, out_sharding=out_sharding)

    def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                   group_offset=None, out_sharding=None):
        """``jax.lax.ragged_dot`` under the provider: ``lhs [M, K]`` tokens sorted by
        group, ``rhs [G, K, N]`` the experts' weights."""
        recipe = self._recipe("ragged_dot")
        if recipe is not None and _is_default(precision):
            if group_offset is not None:
                raise ValueError("ragged_dot: group_offset is not supported by fmtkit's "
                                 "grouped GEMM (fmtkit.fp8.ragged_dot); leave this module "
                                 "to a qwix.QtRule or to no rule.")
            y = fp8.ragged_dot(lhs, rhs, group_sizes, recipe,
                               preferred_element_type=preferred_element_type)
            return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
        # qwix 0.1.8's ragged_dot takes no out_sharding: the output is resharded after it.
        y = super().ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type,
                               group_offset)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
