"""Scaling recipes and quantization: ``x ≈ values * scale`` with one scale per block.

Every recipe is a frozen dataclass and reduces to a *block shape* for a given array shape:
``TensorScaling`` is one block covering the array, ``AxisScaling(axis)`` blocks span ``axis``
completely (one scale per slice along the other axes), ``BlockScaling(block)`` tiles the
trailing dims, ``MXScaling(block)`` tiles one axis in OCP MX blocks. The scale array keeps the
rank of ``x``: ``scale.shape[i] == x.shape[i] // block[i]``, so it broadcasts per block.

Scale rule (all recipes but MX), after Transformer Engine / DeepGEMM:

    amax  = max |x| over the block                       (f32; NaN elements stay NaN values;
                                                           in FP6/FP4, which have no NaN, a
                                                           NaN makes the block's amax inf)
    scale = amax * f32(1 / fmt.max) * 2^margin            (the dequantization multiplier)
    scale = 1                    where amax == 0          (all-zero block: finite scale, TE's rule)
    scale = max(scale, 2^-126)                            (no 0 or f32-subnormal scale: XLA CPU
                                                           flushes those, and x / 0 is inf)
    scale = 2^ceil(log2 scale)   if power_of_two          (DeepGEMM ``ceil_to_ue8m0``: never
                                                           pushes values past fmt.max)
    values = cast(clip(x * (1 / scale), ±fmt.max), fmt)   (round to nearest even; the
                                                           reciprocal is taken once per block)
    values = NaN where x is ±inf                          (delayed / given amax: the scale is
                                                           finite, and the clip would hide an
                                                           overflow; ``keep_nonfinite``)

MX (OCP Microscaling Formats v1.0, section 6.3): ``X = 2^(floor(log2 amax) - emax_elem)`` where
``emax_elem`` is the exponent of the element format's largest normal, an E8M0 scale; elements
``P = cast(clip(V / X, ±max_elem))``. Other scale rules in use: "ceil" (``ceil(log2 amax) -
emax_elem``), "even" (amax rounded to the element precision first, torchao's EVEN) and "rceil"
(``X = 2^ceil(log2(amax / max_elem))``, the smallest power of two with no overflow, used by
cuBLAS/TE). All-zero blocks get X = 1, NaN blocks the E8M0 NaN.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.casting import check_decodable, check_floating, round_to_grid
from fmtkit.formats import Format, get_format

__all__ = [
    "AxisScaling",
    "BlockScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "MXScaling",
    "Recipe",
    "ScaledArray",
    "TensorScaling",
    "compute_scale",
    "delayed_amax",
    "delayed_amax_of",
    "dequantize",
    "keep_nonfinite",
    "qdq",
    "quantize",
    "record_amax",
]

_F32_TINY = np.float32(2.0**-126)  # smallest normal f32: floor for scales (see module doc)
_AMAX_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Input dtypes whose block amax is reduced in place (they have inf: see ``_split_scale``)."""


def _check_margin(margin: int) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool):
        raise TypeError(f"margin must be an int (a power-of-two headroom), got {margin!r}.")


def _check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {value!r}.")


def _check_int(value: Any, name: str, allowed: str) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be {allowed}, got {value!r}.")


def _check_recipe_fields(recipe: Any) -> None:
    """The fields every recipe shares: ``power_of_two`` a bool, ``margin`` an int."""
    if hasattr(recipe, "power_of_two"):
        _check_bool(recipe.power_of_two, "power_of_two")
    if hasattr(recipe, "margin"):
        _check_margin(recipe.margin)


@dataclasses.dataclass(frozen=True)
class TensorScaling:
    """One scale for the whole tensor (current scaling: from this tensor's amax).

    Example:
      >>> x = jnp.arange(1.0, 9.0).reshape(2, 4)
      >>> quantize(x, "e4m3", TensorScaling()).scale.shape     # amax 8 -> scale 8 / 448
      (1, 1)
    """

    power_of_two: bool = False
    margin: int = 0

    def __post_init__(self):
        _check_recipe_fields(self)

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class AxisScaling:
    """One scale per slice: amax is reduced over ``axis`` (an int or tuple of ints).

    ``AxisScaling(-1)`` on x [M, K] gives one scale per row (scale shape [M, 1]);
    ``AxisScaling(0)`` on w [K, N] one per column (scale shape [1, N]).

    Example:
      >>> x = jnp.arange(1.0, 9.0).reshape(2, 4)
      >>> quantize(x, "e4m3", AxisScaling(-1)).scale.shape     # one scale per row
      (2, 1)
    """

    axis: int | tuple[int, ...] = -1
    power_of_two: bool = False
    margin: int = 0

    def __post_init__(self):
        _check_recipe_fields(self)
        axes = (self.axis,) if not isinstance(self.axis, tuple | list) else tuple(self.axis)
        if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            raise TypeError(f"axis must be an int or a tuple of ints, got {self.axis!r}.")

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        ndim = len(shape)
        for a in axes:
            if not -ndim <= a < ndim:
                raise ValueError(f"axis={a} is out of range for an array of shape {shape}.")
        norm = {a % ndim for a in axes}
        return tuple(n if i in norm else 1 for i, n in enumerate(shape))


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """One scale per block; ``block`` tiles the trailing ``len(block)`` dims (leading dims: 1).

    ``BlockScaling((1, 128))`` is DeepSeek-V3's activation tiling (x [M, K] -> scale
    [M, K/128]); ``BlockScaling((128, 128))`` its weight tiling.

    Example:
      >>> x = jnp.arange(1.0, 9.0).reshape(2, 4)
      >>> quantize(x, "e4m3", BlockScaling((1, 2))).scale.shape   # 1x2 tiles
      (2, 2)
    """

    block: tuple[int, ...] = (1, 128)
    power_of_two: bool = False
    margin: int = 0

    def __post_init__(self):
        _check_recipe_fields(self)
        block = (self.block,) if isinstance(self.block, int) else tuple(self.block)
        if not block or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                for b in block):
            raise ValueError(f"block must be a tuple of positive ints, got {self.block!r}.")
        object.__setattr__(self, "block", block)

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(self.block) > len(shape):
            raise ValueError(
                f"block={self.block} has more dims than the array (shape {shape}).")
        lead = len(shape) - len(self.block)
        return (1,) * lead + self.block


_MX_RULES = ("floor", "ceil", "even", "rceil")


@dataclasses.dataclass(frozen=True)
class MXScaling:
    """OCP MX v1.0 block scaling: ``block`` consecutive elements along ``axis`` share an E8M0
    power-of-two scale (block 32 in the spec). ``scale_rounding`` picks the scale rule (see the
    module docstring); "floor" is the spec's.

    Example:
      >>> x = jnp.arange(1.0, 9.0).reshape(2, 4)
      >>> quantize(x, "e4m3", MXScaling(block=4)).scale.tolist()   # powers of two (E8M0)
      [[0.015625], [0.03125]]
    """

    block: int = 32
    scale_rounding: Literal["floor", "ceil", "even", "rceil"] = "floor"
    axis: int = -1

    def __post_init__(self):
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block <= 0:
            raise ValueError(f"block must be a positive int, got {self.block!r}.")
        if self.scale_rounding not in _MX_RULES:
            raise ValueError(
                f"scale_rounding must be one of {_MX_RULES}, got {self.scale_rounding!r}.")
        _check_int(self.axis, "axis", "an int (the axis the blocks run along)")

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        ndim = len(shape)
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"axis={self.axis} is out of range for shape {shape}.")
        ax = self.axis % ndim
        return tuple(self.block if i == ax else 1 for i in range(ndim))


class DelayedScalingState(NamedTuple):
    """Amax histories for delayed scaling (a pytree the caller threads): the one state type
    of every delayed recipe in fmtkit (``DelayedScaling`` and ``fmtkit.fp8``'s dots).

    Attributes:
      amax_history: f32[..., history]; index 0 of the last axis is the most recent amax.
        Leading axes are independent tensors: ``DelayedScaling`` keeps one tensor
        (``[history]``), an FP8 dot three (``[3, history]``: x, w, grad), a scanned stack of
        L dots ``[L, 3, history]``. A tensor whose history is all zeros has recorded nothing
        yet and bootstraps from its current amax (see ``delayed_amax``).
      count: int32 number of recorded steps, or None. Informational only (the bootstrap
        rule reads the history, not the count); FP8 dot states leave it None so that
        ``jax.grad`` can take the whole state (an integer leaf has no float cotangent).

    Example:
      >>> DelayedScaling(history=16).init().amax_history.shape   # one tensor's history
      (16,)
    """

    amax_history: jax.Array
    count: jax.Array | None = None


def _past_amax(hist: jax.Array, algo: str) -> jax.Array:
    """A history's amax: its max (algo "max") or its newest entry ("most_recent")."""
    return jnp.max(hist, axis=-1) if algo == "max" else hist[..., 0]


def delayed_amax(amax_history: jax.Array, current: jax.typing.ArrayLike,
                 algo: Literal["max", "most_recent"] = "max") -> jax.Array:
    """The amax a delayed recipe quantizes with: the history's, or ``current`` before the
    first recorded step (the bootstrap Flax's recipe lacks: its scale starts at 1).

    ``amax_history`` is f32[..., history]; the result has its leading shape. The rule is the
    same for every delayed recipe in fmtkit::

        past   = max(history) if algo == "max" else history[0]
        amax   = current  where every entry of the history is 0 (nothing recorded yet)
                 past     otherwise

    ``delayed_amax_of`` applies the same rule without waiting for ``current``.

    Example:
      >>> delayed_amax(jnp.zeros(4), 3.0).tolist()               # empty history: bootstrap
      3.0
      >>> delayed_amax(jnp.array([2.0, 5.0, 0.0, 0.0]), 3.0).tolist()   # "max" of the history
      5.0
    """
    hist = jnp.asarray(amax_history)
    past = _past_amax(hist, algo)
    return jnp.where(jnp.all(hist == 0, axis=-1), jnp.asarray(current, jnp.float32), past)


def delayed_amax_of(amax_history: jax.Array, operand: jax.Array,
                    amax_fn: Callable[[jax.Array], jax.Array],
                    algo: Literal["max", "most_recent"] = "max") -> jax.Array:
    """``delayed_amax(amax_history, amax_fn(operand), algo)``, with ``amax_fn`` called only
    while some history is empty (under ``lax.cond``).

    Once every history has recorded a step, the quantization then does not wait for the
    current amax: on a mesh that amax is a cross-device max, and without the dependency XLA
    combines every dot's observation into one all-reduce at the end of the step. Under
    ``vmap`` (one history per member, e.g. per seed) the condition becomes "some member's
    history is empty", so it stays one branch instead of JAX's select of both (a
    ``custom_vmap`` rule); members with a history still read it.

    Args:
      amax_history: f32[..., history].
      operand: the tensor whose amax bootstraps an empty history.
      amax_fn: ``operand -> f32 amax`` of the history's leading shape (e.g. a max that
        ``lax.pmax``-reduces over a mesh axis).
      algo: as in ``delayed_amax``.
    """
    def rule(hist, operand, amax_fn):
        past = _past_amax(hist, algo)
        empty = jnp.all(hist == 0, axis=-1)
        return jax.lax.cond(
            jnp.any(empty),
            lambda: jnp.where(empty, jnp.asarray(amax_fn(operand), jnp.float32), past),
            lambda: past)

    @jax.custom_batching.custom_vmap
    def bootstrapped(hist, operand):
        return rule(hist, operand, amax_fn)

    @bootstrapped.def_vmap
    def _batched(axis_size, in_batched, hist, operand):
        hist, operand = (x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                         for x, batched in zip((hist, operand), in_batched))
        return rule(hist, operand, jax.vmap(amax_fn)), True

    return bootstrapped(jnp.asarray(amax_history, jnp.float32), operand)


def record_amax(amax_history: jax.Array, amax: jax.typing.ArrayLike, *,
                group_ndim: int = 0) -> jax.Array:
    """The one history update of every delayed recipe: roll by one, record ``amax`` newest.

    Args:
      amax_history: f32[..., history] (index 0 of the last axis newest).
      amax: the observed amaxes, shape ``amax_history.shape[:-1]``.
      group_ndim: the trailing axes of ``amax`` that form one unit for the finiteness check
        (0: each tensor on its own; 1 for FP8 dots, whose x / w / grad rows are recorded or
        skipped together, per dot and per layer of a stack).

    Returns:
      The new history. A unit with a non-finite observation (an overflowing step that loss
      scaling will skip) keeps its history unchanged: an inf in the history would poison the
      scale for ``history`` steps.

    Example:
      >>> record_amax(jnp.array([2.0, 5.0, 0.0, 0.0]), 7.0).tolist()    # newest at index 0
      [7.0, 2.0, 5.0, 0.0]
    """
    hist = jnp.asarray(amax_history)
    amax = jnp.asarray(amax, hist.dtype)
    if amax.shape != hist.shape[:-1]:
        raise ValueError(f"amax has shape {amax.shape}; the history {hist.shape} needs "
                         f"{hist.shape[:-1]}.")
    rolled = jnp.concatenate([amax[..., None], hist[..., :-1]], axis=-1)
    ok = jnp.isfinite(amax)
    if group_ndim:
        ok = jnp.all(ok, axis=tuple(range(-group_ndim, 0)), keepdims=True)
        ok = jnp.broadcast_to(ok, amax.shape)
    return jnp.where(ok[..., None], rolled, hist)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor delayed scaling: the scale comes from the amax history of earlier steps.

    Defaults are Transformer Engine's ``DelayedScaling`` (history 1024, "max", margin 0).
    The first step (empty history) bootstraps from the current amax instead of casting
    unscaled, the failure of Flax's recipe (its scale starts at 1). History rules
    (``delayed_amax``, ``record_amax``) are shared with ``fmtkit.fp8``'s delayed recipe.

    Example:
      >>> recipe = DelayedScaling(history=16)
      >>> state = recipe.init()
      >>> x = jnp.ones((4, 8))
      >>> sa = quantize(x, "e4m3", recipe, state=state)
      >>> state = recipe.update(state, x)
    """

    history: int = 1024
    algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    power_of_two: bool = False

    def __post_init__(self):
        _check_recipe_fields(self)
        if not isinstance(self.history, int) or isinstance(self.history, bool) or (
                self.history <= 0):
            raise ValueError(f"history must be a positive int, got {self.history!r}.")
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {self.algo!r}.")

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def init(self) -> DelayedScalingState:
        return DelayedScalingState(jnp.zeros((self.history,), jnp.float32),
                                   jnp.zeros((), jnp.int32))

    def history_amax(self, state: DelayedScalingState) -> jax.Array:
        """The amax the next quantization uses (before bootstrapping)."""
        return _past_amax(state.amax_history, self.algo)

    def update(self, state: DelayedScalingState, x_or_amax: jax.typing.ArrayLike
               ) -> DelayedScalingState:
        """Rolls the history and records ``amax(x)`` (pass an array, or its scalar amax).

        A non-finite amax is not recorded (``record_amax``; the count does not advance).
        Under gradient accumulation, combine the micro-batches' amaxes with ``max`` before
        recording (or call ``record_max``) so the history holds the max over the batch.
        """
        x = jnp.asarray(x_or_amax)
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if x.ndim else x.astype(jnp.float32)
        hist = record_amax(state.amax_history, amax)
        count = state.count
        if count is not None:
            count = count + jnp.isfinite(amax).astype(count.dtype)
        return DelayedScalingState(hist, count)

    def record_max(self, state: DelayedScalingState, amax: jax.typing.ArrayLike
                   ) -> DelayedScalingState:
        """Combines ``amax`` into the newest history entry with max (accumulation steps)."""
        amax = jnp.asarray(amax, jnp.float32)
        return state._replace(amax_history=state.amax_history.at[..., 0].max(amax))


Recipe = TensorScaling | AxisScaling | BlockScaling | MXScaling | DelayedScaling
"""Any scaling recipe: the type of ``quantize``'s ``recipe`` argument."""
_RECIPE_TYPES = (TensorScaling, AxisScaling, BlockScaling, MXScaling, DelayedScaling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledArray:
    """Quantized values with their scales: ``x ≈ values * scale`` (scale broadcast per block).

    A pytree: ``values`` and ``scale`` are leaves; ``fmt`` and ``recipe`` are static.

    Attributes:
      values: array of ``fmt.dtype`` with the shape of x (FP6 values are held exactly in a
        float8_e4m3fn container: XLA's CPU backend cannot decode FP6 arrays).
      scale: f32 (E8M0 for MX) array with x's rank, ``shape[i] = x.shape[i] // block[i]``.
      fmt: the element format.
      recipe: the recipe that produced it.

    Example:
      >>> sa = quantize(jnp.array([[1.0, -2.0, 448.0]]), "e4m3", TensorScaling())
      >>> sa.values.dtype, sa.scale.tolist()
      (dtype(float8_e4m3fn), [[1.0]])
    """

    values: jax.Array
    scale: jax.Array
    fmt: Format = dataclasses.field(metadata=dict(static=True))
    recipe: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def block(self) -> tuple[int, ...]:
        # (an empty dim has an empty scale dim: its block counts as 1)
        return tuple(n // s if s else 1 for n, s in zip(self.values.shape, self.scale.shape))

    def expanded_scale(self) -> jax.Array:
        """The f32 scale broadcast to the full shape of ``values``."""
        return blockwise(lambda v, s: jnp.broadcast_to(s, v.shape), self.values,
                         self.scale.astype(jnp.float32), self.block)


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, _RECIPE_TYPES):
        names = ", ".join(t.__name__ for t in _RECIPE_TYPES)
        raise TypeError(f"recipe must be one of {names}; got {recipe!r}.")


def _check_blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> None:
    for i, (n, b) in enumerate(zip(shape, block)):
        if n % b:
            raise ValueError(
                f"x.shape[{i}]={n} is not divisible by the block size {b} "
                f"(block shape {block} for an array of shape {shape}).")


def _block_layout(shape: tuple[int, ...], block: tuple[int, ...]
                  ) -> tuple[list[int], tuple[int, ...], list[int]]:
    """Splits each blocked dim into (blocks, block) and returns (split shape, axes to reduce,
    per-block shape in that split layout). Dims with block 1 or one block are not split, so
    XLA sees the simplest reshape (a (1, 128) tiling of [M, K] is just [M, K/128, 128])."""
    split, reduce_axes, kept = [], [], []
    for n, b in zip(shape, block):
        if b == 1:
            split.append(n)
            kept.append(n)
        elif b == n:
            reduce_axes.append(len(split))
            split.append(n)
            kept.append(1)
        else:
            split += [n // b, b]
            reduce_axes.append(len(split) - 1)
            kept += [n // b, 1]
    return split, tuple(reduce_axes), kept


def blockwise(fn, x: jax.Array, scale: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Applies ``fn(x_block_view, scale_view)`` with the scale broadcast over its blocks.

    Both are reshaped to the split layout of ``_block_layout`` (x [M, K] with (1, 128) blocks
    becomes [M, K/128, 128] and the scale [M, K/128, 1]) so XLA fuses a plain broadcast
    instead of per-element index arithmetic; the result is reshaped back to x's shape.
    """
    split, axes, kept = _block_layout(x.shape, block)
    if not axes:
        return fn(x, scale)
    return fn(x.reshape(split), scale.reshape(kept)).reshape(x.shape)


def _ceil_pow2(s: jax.Array) -> jax.Array:
    """Rounds positive f32 up to a power of two, exactly (frexp: s = m * 2^e, m in [0.5, 1))."""
    m, e = jnp.frexp(s)
    e = jnp.where(m == 0.5, e - 1, e)
    return jnp.where(jnp.isfinite(s), jnp.ldexp(jnp.float32(1.0), e), s)


def _amax_to_scale(amax: jax.Array, fmt: Format, margin: int, power_of_two: bool) -> jax.Array:
    # amax * (1/max) rather than amax / max: XLA CPU rewrites division by a constant into this
    # product, so writing it out keeps every backend (and the Pallas quantizers) identical.
    scale = amax * jnp.float32(1.0 / fmt.max) * jnp.float32(2.0**margin)
    scale = jnp.where(amax == 0, jnp.float32(1.0), jnp.maximum(scale, _F32_TINY))
    # Non-finite amax (inf or NaN in the block): scale inf, values x * 0 (NaN for inf/NaN
    # elements), and the block dequantizes to NaN (0 * inf): NaN in, NaN out.
    return _ceil_pow2(scale) if power_of_two else scale


def _floor_log2(a: jax.Array) -> jax.Array:
    _, e = jnp.frexp(a)
    return e - 1


def _mx_exponent(amax: jax.Array, fmt: Format, rule: str) -> jax.Array:
    """int32 exponent e of the E8M0 scale 2^e per OCP MX v1.0 (and the other rules)."""
    emax_elem = math.floor(math.log2(fmt.max))  # exponent of the largest normal (448 -> 8)
    if rule == "floor":
        e = _floor_log2(amax) - emax_elem
    elif rule == "ceil":
        m, e = jnp.frexp(amax)
        e = jnp.where(m == 0.5, e - 1, e) - emax_elem
    elif rule == "even":
        # Round amax half-up at the element's mantissa width on the f32 bit pattern (torchao).
        bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
        bits = (bits + jnp.uint32(1 << (22 - fmt.mantissa_bits))) & jnp.uint32(0x7F800000)
        e = _floor_log2(jax.lax.bitcast_convert_type(bits, jnp.float32)) - emax_elem
    else:  # rceil: smallest k with amax <= max * 2^k
        m, e = jnp.frexp(amax / jnp.float32(fmt.max))
        k = jnp.where(m == 0.5, e - 1, e)
        e = jnp.where(amax > jnp.ldexp(jnp.float32(fmt.max), k), k + 1, k)
    e = jnp.where(amax == 0, 0, e)  # all-zero block: scale 1
    return jnp.clip(e, -127, 127)  # E8M0 range


def _split_scale(xs: jax.Array, axes: tuple[int, ...], fmt: Format, recipe: Recipe,
                 state: DelayedScalingState | None, amax: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """(stored scale, f32 reciprocal) per block of ``xs`` (x in its split layout), keepdims
    over ``axes``. MX scales are E8M0, built from their exponent bits: 2^-127 is an f32
    subnormal, which XLA CPU arithmetic would flush to 0 (then 1/0), so the reciprocal
    2^-e is formed directly as well."""
    if amax is not None:
        amax = jnp.asarray(amax, jnp.float32).reshape((1,) * xs.ndim)
        return _scale_and_inverse(amax, fmt, recipe, state)
    # |x| and its block max in x's own dtype when it has inf (bf16, f16, f32), then f32:
    # exact (they only pick elements), and a bf16 x is not first converted into an f32 copy.
    a = jnp.abs(xs if xs.dtype in _AMAX_DTYPES else xs.astype(jnp.float32))
    if not fmt.has_nan:
        # FP6/FP4 cannot store a NaN element, and XLA's CPU max reduction drops NaN: map NaN
        # to inf so the block's amax is non-finite and the block dequantizes to NaN. (Formats
        # with NaN keep NaN elements as NaN values; their reduction stays on the fast path.)
        a = jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, a.dtype), a)
    amax = (jnp.max(a, axis=axes, keepdims=True) if axes else a).astype(jnp.float32)
    if isinstance(recipe, MXScaling):
        e = _mx_exponent(amax, fmt, recipe.scale_rounding)
        nan = ~jnp.isfinite(amax)
        code = jnp.where(nan, 0xFF, e + 127).astype(jnp.uint8)  # bias 127; 0xFF is NaN
        scale = jax.lax.bitcast_convert_type(code, jnp.float8_e8m0fnu)
        inv = jnp.where(nan, jnp.float32(jnp.nan), jnp.ldexp(jnp.float32(1.0), -e))
        return scale, inv
    return _scale_and_inverse(amax, fmt, recipe, state)


def _scale_and_inverse(amax, fmt, recipe, state):
    if isinstance(recipe, DelayedScaling):
        if state is None:
            raise ValueError("DelayedScaling needs its state: quantize(x, fmt, recipe, "
                             "state=recipe.init()); thread recipe.update(state, x) per step.")
        if state.amax_history.shape != (recipe.history,):
            raise ValueError(f"state.amax_history has shape {state.amax_history.shape}; "
                             f"DelayedScaling(history={recipe.history}) needs "
                             f"({recipe.history},).")
        amax = delayed_amax(state.amax_history, amax, recipe.algo)
    scale = _amax_to_scale(amax, fmt, recipe.margin, recipe.power_of_two)
    return scale, jnp.float32(1.0) / scale


def _prepare(x: jax.typing.ArrayLike, fmt: str | Format, recipe: Recipe):
    fmt = get_format(fmt)
    _check_recipe(recipe)
    x = check_floating(x)
    # A block spanning an empty dim (per-tensor or per-axis scaling of a [0, K] array) has
    # size 0: count it as 1, so an empty array quantizes to empty values and scales.
    block = tuple(max(b, 1) for b in recipe.block_shape(x.shape))
    _check_blocks(x.shape, block)
    split, axes, _ = _block_layout(x.shape, block)
    scale_shape = tuple(n // b for n, b in zip(x.shape, block))
    return x, fmt, x.reshape(split), axes, scale_shape


def compute_scale(x: jax.typing.ArrayLike, fmt: str | Format, recipe: Recipe, *,
                  state: DelayedScalingState | None = None) -> jax.Array:
    """The per-block f32 scale ``quantize`` would use (E8M0-valued f32 for MX).

    Example:
      >>> compute_scale(jnp.array([[1.0, 448.0]]), "e4m3", TensorScaling()).tolist()
      [[1.0]]
    """
    _, fmt, xs, axes, scale_shape = _prepare(x, fmt, recipe)
    scale, _ = _split_scale(xs, axes, fmt, recipe, state)
    return scale.astype(jnp.float32).reshape(scale_shape)


def quantize(x: jax.typing.ArrayLike, fmt: str | Format, recipe: Recipe = TensorScaling(), *,
             state: DelayedScalingState | None = None,
             amax: jax.typing.ArrayLike | None = None,
             amax_covers_x: bool = False) -> ScaledArray:
    """Quantizes ``x`` to ``fmt`` with one scale per block of ``recipe``.

    Args:
      x: floating array.
      fmt: element format (name, alias, dtype or Format), e.g. "e4m3".
      recipe: a scaling recipe (default: per-tensor current scaling).
      state: the ``DelayedScalingState`` (only for ``DelayedScaling``); its history is not
        updated here: call ``recipe.update(state, x)`` after the step.
      amax: per-tensor recipes only (``TensorScaling``, ``DelayedScaling``): the current
        amax to use instead of ``max |x|`` (a mesh-reduced amax, or one already computed);
        a delayed recipe still prefers its recorded history.
      amax_covers_x: the given ``amax`` is a maximum over every element of ``x`` (``max |x|``
        itself, or a mesh-wide ``pmax`` of it), not a history's: an inf element then makes
        the scale inf and its value NaN by itself (``keep_nonfinite``'s rule), so the
        element-wise inf check is skipped (one pass over ``x`` less; same values).

    Returns:
      A ``ScaledArray`` with ``values`` in ``fmt.dtype`` and ``scale`` (f32; E8M0 for MX).

    Raises:
      TypeError: x is not floating, or recipe is not a recipe.
      ValueError: unknown format, a block that does not divide x's shape, missing state.

    Example:
      >>> sa = quantize(jnp.ones((2, 256)), "e4m3", BlockScaling((1, 128)))
      >>> sa.scale.shape
      (2, 2)
    """
    x, fmt, xs, axes, scale_shape = _prepare(x, fmt, recipe)
    if amax is not None and not isinstance(recipe, TensorScaling | DelayedScaling):
        raise ValueError(f"amax= is for per-tensor recipes (TensorScaling, DelayedScaling), "
                         f"got {type(recipe).__name__}.")
    scale, inv = _split_scale(xs, axes, fmt, recipe, state, amax)
    # Multiply by the per-block reciprocal (what XLA CPU turns a division into anyway, and
    # what the Pallas quantizers do), then clip: formats without inf turn |v| > max into NaN
    # (f32 -> e4m3fn beyond 464).
    v = jnp.clip(xs.astype(jnp.float32) * inv, -fmt.max, fmt.max)
    if isinstance(recipe, DelayedScaling) or (amax is not None and not amax_covers_x):
        # The scale did not come from this block's own amax, so an inf element meets a finite
        # reciprocal and the clip above would turn it into ±fmt.max: keep it non-finite.
        v = keep_nonfinite(xs, v)
    if fmt.bits == 6:
        # XLA's CPU backend cannot decode FP6; every FP6 value is exact in E4M3, so the
        # values are rounded onto the FP6 grid and kept in an E4M3 container.
        values = round_to_grid(v, fmt).astype(jnp.float8_e4m3fn)
    else:
        values = v.astype(fmt.dtype)
    return ScaledArray(values.reshape(x.shape), scale.reshape(scale_shape), fmt, recipe)


def keep_nonfinite(x: jax.Array, values: jax.Array) -> jax.Array:
    """``values`` (clipped, scaled ``x``) with NaN wherever ``x`` is inf: NaN in, NaN out.

    A scale taken from the block's own amax needs no help (an inf element makes the scale
    inf and the element ``inf * 0 = NaN``; a NaN survives the clip), but a scale from
    elsewhere (an amax history, a given ``amax``, no scale at all) is finite, and
    ``clip(inf * s) = fmt.max`` would hide an overflow from loss scaling. NaN rather than
    inf because E4M3 has no inf; any non-finite operand makes a GEMM's products non-finite.
    Finite elements beyond the range still saturate.

    Example:
      >>> keep_nonfinite(jnp.array([jnp.inf, 1.0]), jnp.array([448.0, 1.0])).tolist()
      [nan, 1.0]
    """
    return jnp.where(jnp.isinf(x), jnp.float32(jnp.nan), values)


def dequantize(sa: ScaledArray, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    """Returns ``values * scale`` (computed in f32, then cast to ``dtype``).

    Example:
      >>> sa = quantize(jnp.array([[1.0, 3.0, 5.0, 8.0]]), "e4m3", AxisScaling(-1))
      >>> dequantize(sa).tolist()                  # 3 and 5 round on the scaled E4M3 grid
      [[1.0, 2.857142925262451, 5.142857551574707, 8.0]]
    """
    if not isinstance(sa, ScaledArray):
        raise TypeError(f"dequantize expects a ScaledArray, got {type(sa).__name__}.")
    check_decodable(sa.values, "sa.values")
    out = blockwise(lambda v, s: v.astype(jnp.float32) * s, sa.values,
                    sa.scale.astype(jnp.float32), sa.block)
    return out.astype(dtype)


def _qdq_impl(x, fmt, recipe, state):
    return dequantize(quantize(x, fmt, recipe, state=state), x.dtype)


def qdq(x: jax.typing.ArrayLike, fmt: str | Format, recipe: Recipe = TensorScaling(), *,
        state: DelayedScalingState | None = None) -> jax.Array:
    """Quantize then dequantize, back in x's dtype; the gradient is straight-through.

    Example:
      >>> # scale 2^-8 (amax 1 / 448 rounded up); 0.3 * 256 = 76.8 lies on E4M3's grid of 8
      >>> qdq(jnp.array([1.0, 0.3]), "e4m3", TensorScaling(power_of_two=True)).tolist()
      [1.0, 0.3125]
    """
    fmt = get_format(fmt)
    x = check_floating(x)
    return _qdq_st(x, state, fmt, recipe)


def _qdq_st_fwd(x, state, fmt, recipe):
    return _qdq_impl(x, fmt, recipe, state)


_qdq_st = jax.custom_jvp(_qdq_st_fwd, nondiff_argnums=(2, 3))


@_qdq_st.defjvp
def _qdq_st_jvp(fmt, recipe, primals, tangents):
    x, state = primals
    tx, _ = tangents
    return _qdq_st(x, state, fmt, recipe), tx
