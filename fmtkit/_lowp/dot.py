"""The differentiable FP8 dot with ``lax.dot_general``'s signature: ``dot_general_fn`` (the
function Flax modules take) and ``dot_general`` (the op).

Any contracting and batch dims are flattened to a 2-D GEMM per batch element,
``x [M, K] · w [N, K]ᵀ``, computed by the recipe's core (``fp8_dot``, or
``fp4_dot`` for an FP4 recipe) and reshaped back.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit._lowp.fp4_core import fp4_dot
from fmtkit._lowp.fp8_core import fp8_dot
from fmtkit._lowp.gemm import gemm_dtype
from fmtkit._lowp.recipes import Fp4Recipe, Fp8Recipe, get_recipe
from fmtkit.casting import check_floating
from fmtkit.scaling import DelayedScalingState


def _layout(lhs_shape, rhs_shape, dimension_numbers):
    """How ``_canonicalize`` lays the operands out: (lhs permutation, rhs permutation,
    batch shape, M, N, K, output shape); ValueError for dims that do not match."""
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError("lhs and rhs need as many contracting (and batch) dims")
    for dl, dr in ((lc, rc), (lb, rb)):
        for a, b in zip(dl, dr):
            if lhs_shape[a] != rhs_shape[b]:
                raise ValueError(f"lhs dim {a} (size {lhs_shape[a]}) and rhs dim {b} "
                                 f"(size {rhs_shape[b]}) differ")
    lc, rc, lb, rb = (tuple(int(d) % len(shape) for d in ds) for ds, shape in
                      ((lc, lhs_shape), (rc, rhs_shape), (lb, lhs_shape), (rb, rhs_shape)))
    lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    batch = tuple(lhs_shape[d] for d in lb)
    m = math.prod(lhs_shape[d] for d in lf)
    n = math.prod(rhs_shape[d] for d in rf)
    k = math.prod(lhs_shape[d] for d in lc)
    out_shape = (*batch, *(lhs_shape[d] for d in lf), *(rhs_shape[d] for d in rf))
    return (*lb, *lf, *lc), (*rb, *rf, *rc), batch, m, n, k, out_shape


def _canonicalize(lhs, rhs, layout):
    """``x [*batch, M, K]`` and ``w [*batch, N, K]`` of the operands laid out by ``_layout``:
    batch dims first, then the free dims, then the contracting ones, flattened."""
    lperm, rperm, batch, m, n, k, _ = layout
    return (lhs.transpose(*lperm).reshape(*batch, m, k),
            rhs.transpose(*rperm).reshape(*batch, n, k))


_DEFAULT_PRECISIONS = (None, lax.Precision.DEFAULT)


def _check_precision(precision: Any, where: str) -> None:
    """Accepts ``precision`` values that ask for nothing beyond an FP8 GEMM (None, DEFAULT,
    or a pair of those); raises on HIGH / HIGHEST / an algorithm, which it cannot honour."""
    ps = precision if isinstance(precision, tuple | list) else (precision,)
    for p in ps:
        if isinstance(p, str):
            try:
                p = lax.Precision(p)
            except (ValueError, KeyError):
                raise ValueError(f"{where}: precision={precision!r} is not a lax.Precision; "
                                 "use None or lax.Precision.DEFAULT.") from None
        if p not in _DEFAULT_PRECISIONS:
            raise ValueError(
                f"{where}: precision={precision!r} asks for more precise products than an "
                "FP8 GEMM computes (its products are FP8 x FP8, exact, accumulated in f32 by "
                "construction). Drop precision (None / lax.Precision.DEFAULT), or keep this "
                "matmul out of the FP8 recipe (e.g. a bf16/f32 rule for its module).")


def _check_out_sharding(out_sharding: Any, where: str) -> None:
    if out_sharding is not None and not isinstance(
            out_sharding, jax.sharding.Sharding | jax.sharding.PartitionSpec):
        raise TypeError(f"{where}: out_sharding must be None, a jax.sharding.Sharding or a "
                        f"PartitionSpec (as for lax.dot_general), got {out_sharding!r}.")


def _check_out_dtype(preferred_element_type: Any, where: str) -> Any:
    if preferred_element_type is None:
        return None
    try:
        dtype = jnp.dtype(preferred_element_type)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: preferred_element_type must be a floating dtype (the "
                        f"output dtype; the GEMMs accumulate in f32), got "
                        f"{preferred_element_type!r}.")
    return dtype


def _where(recipe: Fp8Recipe, name: str | None) -> str:
    return (f"fmtkit.fp8.dot_general({recipe}) at {name!r}" if name else
            f"fmtkit.fp8.dot_general({recipe})")


def _fp8_dot(recipe: Fp8Recipe, where: str, lhs, rhs, dimension_numbers, precision,
             preferred_element_type, out_sharding, fp8_state):
    """The op behind ``dot_general`` and the functions ``dot_general_fn`` returns."""
    _check_precision(precision, where)
    _check_out_sharding(out_sharding, where)
    preferred_element_type = _check_out_dtype(preferred_element_type, where)
    try:
        lhs = check_floating(lhs, "lhs")
        rhs = check_floating(rhs, "rhs")
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    out_dtype = preferred_element_type or (
        lhs.dtype if lhs.dtype == rhs.dtype else jnp.float32)
    if recipe.delayed and fp8_state is None:
        raise ValueError(f"{where}: recipe {recipe.name!r} is delayed: pass fp8_state= "
                         "(see fmtkit.fp8.init_state) or use the Flax module wrappers.")
    try:
        layout = _layout(lhs.shape, rhs.shape, dimension_numbers)
        _, _, batch, m, n, k, out_shape = layout
        nbatch = len(batch)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"{where}: bad dimension_numbers {dimension_numbers!r} for "
                         f"lhs {lhs.shape} and rhs {rhs.shape}: {e}") from None
    if recipe.delayed:
        # A batched dot (per-expert GEMMs, "egcd,edf->egcf") keeps one history per batch
        # element, [*batch, 3, history]: each expert's weights get their own scale.
        hist = jnp.asarray(fp8_state.amax_history)
        need = (*batch, 3, recipe.history)
        if hist.shape != need:
            extra = (" A stack of layers (nn.scan / nnx.scan) keeps one history per "
                     "layer, [L, 3, history]: scan over the fp8_state collection too "
                     "(linen: variable_axes={'params': 0, 'fp8_state': 0}) so each "
                     "layer's dot sees its own slice." if hist.ndim == len(need) + 1
                     else "")
            raise ValueError(f"{where}: fp8_state.amax_history has shape {hist.shape}; "
                             f"this dot needs {need} (one history per batch element; "
                             "rows x, w, grad)." + extra)
    else:
        hist = jnp.zeros((3, 1), jnp.float32)
    if 0 in (m, n, k) or 0 in batch:
        # An empty operand (no tokens, an empty contraction, no features): lax.dot_general's
        # answer, zeros of the output shape (empty, or a sum over nothing); no GEMM to run.
        y = jnp.zeros(out_shape, out_dtype)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
    # FP4 recipes run the FP4 core (its GEMMs take E2M1 operands), others the FP8 core.
    core = functools.partial(fp4_dot if isinstance(recipe, Fp4Recipe) else fp8_dot,
                             recipe, gemm_dtype(out_dtype))
    for _ in range(nbatch):
        core = jax.vmap(core, in_axes=(0, 0, 0 if recipe.delayed else None))

    def compute(lhs, rhs, hist):
        x, w = _canonicalize(lhs, rhs, layout)
        return core(x, w, hist).reshape(out_shape).astype(out_dtype)

    explicit = _explicit_axes()
    # An explicit-sharding mesh: the quantization and the three GEMMs run with the mesh's
    # axes in auto mode (XLA partitions them as it partitions the dots they replace), and y
    # gets the sharding lax.dot_general gives (out_sharding, or its own rule, which raises
    # JAX's error where that is ambiguous); the gradients get their operands' shardings, as
    # the transposes of the traced dot would. Operands on no mesh (arrays made before
    # jax.set_mesh and passed into a jit under it) give no sharding: the GEMMs run as they are.
    if explicit and out_sharding is None:
        out_sharding = jax.eval_shape(functools.partial(
            lax.dot_general, dimension_numbers=dimension_numbers,
            preferred_element_type=out_dtype), lhs, rhs).sharding
    if not explicit or out_sharding is None:
        y = compute(lhs, rhs, hist)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
    return jax.sharding.auto_axes(compute, axes=explicit, out_sharding=out_sharding)(
        lhs, rhs, hist)


def _explicit_axes() -> tuple[str, ...]:
    """The names of the current mesh's explicit axes (``jax.set_mesh`` with
    ``AxisType.Explicit``), or () outside such a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                 if t == jax.sharding.AxisType.Explicit)


def dot_general_fn(recipe: str | Fp8Recipe = "blockwise", *, name: str | None = None):
    """Returns a function with ``lax.dot_general``'s signature that computes in FP8.

    Plugs into ``nn.Dense(dot_general=...)``, ``nn.DenseGeneral``, ``nn.Einsum`` and
    ``nnx.Linear(dot_general=...)``. Any contracting and batch dims are accepted (they are
    flattened to a 2-D GEMM per batch element), of any size: a dimension that a recipe's
    blocks do not divide is zero-padded inside each GEMM (exact). Delayed recipes take their
    state as the keyword ``fp8_state`` (a ``fmtkit.DelayedScalingState``, see ``init_state``);
    the linen / NNX module wrappers
    in ``fmtkit.policy`` thread it for you.

    ``lax.dot_general``'s keywords are taken by name: ``preferred_element_type`` is the
    output dtype (a floating dtype; the GEMMs accumulate in f32), ``out_sharding`` the
    output's sharding (``jax.sharding.reshard``), ``precision`` only None or
    ``lax.Precision.DEFAULT`` (FP8 products are exact and accumulated in f32 by
    construction: HIGH / HIGHEST raise instead of being ignored). Any other keyword is a
    ``TypeError``.

    Args:
      recipe: a name from ``RECIPES`` or an ``Fp8Recipe``.
      name: what the errors of the returned function call this dot (the policy layer passes
        the module path, e.g. "Block_0/MlpBlock_0/Dense_0").

    Returns:
      ``fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
      preferred_element_type=None, *, out_sharding=None, fp8_state=None)``.

    Example:
      >>> dg = dot_general_fn("blockwise")
      >>> x, w = jnp.ones((128, 200)), jnp.ones((200, 100))
      >>> dg(x, w, (((1,), (0,)), ((), ()))).shape
      (128, 100)
    """
    recipe = get_recipe(recipe)
    where = _where(recipe, name)

    def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, out_sharding=None,
                        fp8_state: DelayedScalingState | None = None):
        return _fp8_dot(recipe, where, lhs, rhs, dimension_numbers, precision,
                        preferred_element_type, out_sharding, fp8_state)

    fp8_dot_general.recipe = recipe  # type: ignore[attr-defined]
    fp8_dot_general.name = name  # type: ignore[attr-defined]
    return fp8_dot_general


_UNSET: Any = object()  # "no operand": dot_general() / dot_general(recipe=...), the factory


def dot_general(lhs: Any = _UNSET, rhs: jax.typing.ArrayLike | None = None,
                dimension_numbers: Any = None, precision: Any = None,
                preferred_element_type: jax.typing.DTypeLike | None = None, *,
                out_sharding: Any = None, recipe: str | Fp8Recipe | None = None,
                fp8_state: DelayedScalingState | None = None, name: str | None = None):
    """``lax.dot_general`` in FP8: the op (the factory is ``dot_general_fn``).

    ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
    *, out_sharding=None, recipe="blockwise", fp8_state=None)`` computes the product with the
    recipe's three FP8 GEMMs (``jax.jvp``: the tangent through the forward GEMM's quantized
    operands, in f32; see ``dot_general_fn`` for the keywords' meaning).

    ``dot_general(recipe)`` (a name or an ``Fp8Recipe`` as the only positional argument, or
    ``dot_general(recipe=...)`` with no operands) is the deprecated spelling of
    ``dot_general_fn(recipe, name=name)``, the factory: it warns (``DeprecationWarning``) and
    returns that function. The first argument of the op is an array, never a string or a
    recipe, so the two forms cannot be confused.

    Example:
      >>> x, w = jnp.ones((128, 200)), jnp.ones((200, 100))
      >>> dot_general(x, w, (((1,), (0,)), ((), ())), recipe="current").shape
      (128, 100)
    """
    if lhs is None:
        raise TypeError("fmtkit.fp8.dot_general: lhs is None; pass an array (the op) or a "
                        "recipe name / Fp8Recipe (the factory).")
    if lhs is _UNSET or isinstance(lhs, str | Fp8Recipe):
        extra = {k: v for k, v in dict(
            rhs=rhs, dimension_numbers=dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
            fp8_state=fp8_state).items() if v is not None}
        if lhs is not _UNSET and recipe is not None:
            raise TypeError("fmtkit.fp8.dot_general: the recipe was given twice "
                            f"({lhs!r} and recipe={recipe!r}).")
        if extra:
            raise TypeError(
                "fmtkit.fp8.dot_general: called with a recipe first, it returns the FP8 "
                f"function (dot_general_fn); the operands go to that function, got "
                f"{', '.join(extra)} here. The op takes the arrays first: "
                "dot_general(lhs, rhs, dimension_numbers, recipe=...).")
        if lhs is _UNSET:
            lhs = "blockwise" if recipe is None else recipe
        warnings.warn("fmtkit.fp8.dot_general(recipe), the factory form, is deprecated: use "
                      "fmtkit.fp8.dot_general_fn(recipe), which returns the same function.",
                      DeprecationWarning, stacklevel=2)
        return dot_general_fn(lhs, name=name)
    if rhs is None or dimension_numbers is None:
        raise TypeError("fmtkit.fp8.dot_general(lhs, rhs, dimension_numbers, ...): rhs and "
                        "dimension_numbers are required (or pass only a recipe to get the "
                        "FP8 function).")
    r = get_recipe("blockwise" if recipe is None else recipe)
    return _fp8_dot(r, _where(r, name), lhs, rhs, dimension_numbers, precision,
                    preferred_element_type, out_sharding, fp8_state)
