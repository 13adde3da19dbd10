"""FP8 training matmuls: a scaled ``dot_general`` with a custom VJP and named recipes.

Each of the three GEMMs of a linear layer receives real FP8 operands (FP8 arrays into
``lax.dot_general`` with ``preferred_element_type=f32``), each operand quantized along the
axis that GEMM contracts over:

    forward   y  = x  · w      contracts K        x tiles along K, w tiles along K
    dgrad     dx = dy · wᵀ     contracts N        dy tiles along N, w tiles along N
    wgrad     dw = xᵀ · dy     contracts tokens   x and dy tiles along the tokens

A GEMM of quantized ``a [F1, C]`` and ``b [F2, C]`` (both contraction-minor, DeepSeek's
K-major layout) with scales per tile is computed with the scales applied per block of the
contraction (DeepSeek-V3's promotion into f32):

    g = the smaller contraction tile of a and b
    out[i, j] = sum_kb  sa[i, kb] * sb[j, kb] * (a_q[i, kb*g:(kb+1)*g] · b_q[j, kb*g:(kb+1)*g])

with each partial product an FP8 dot accumulated in f32. When both scales are constant along
the contraction (per-tensor, per-row) this is one FP8 dot followed by the outer product of
the scales.

Recipes (``RECIPES``; every field overridable with ``dataclasses.replace``):

    current    per tensor, just in time; E4M3 x/w, E5M2 gradients (TE "HYBRID")
    delayed    per tensor from an amax history (TE / Flax defaults: 1024, "max", margin 0),
               first step bootstrapped from the current amax; state threaded explicitly
    rowwise    one scale per row of each operand along the contraction (x rows, w columns)
    blockwise  DeepSeek-V3: 1x128 activations and gradients, 128x128 weights, E4M3 everywhere
    mxfp8      OCP MX: 1x32 tiles along the contraction with E8M0 power-of-two scales, E4M3
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.casting import check_floating
from fmtkit.formats import get_format
from fmtkit.scaling import (
    AxisScaling,
    BlockScaling,
    DelayedScaling,
    DelayedScalingState,
    MXScaling,
    ScaledArray,
    TensorScaling,
    quantize,
)

__all__ = [
    "RECIPES",
    "FP8Recipe",
    "Fp8DotState",
    "combine_observations",
    "dot_general",
    "get_recipe",
    "init_state",
    "limited_precision_matmul",
    "scaled_matmul",
    "update_state",
]

_TILE_RE = re.compile(r"^(tensor|row|none|mx(\d+)|(\d+)x(\d+))$")


def _parse_tile(spec: str, arg: str) -> tuple[str, tuple[int, int] | int | None]:
    m = _TILE_RE.match(spec)
    if not m:
        raise ValueError(
            f"{arg}={spec!r} is not a tiling; use 'tensor', 'row', 'none', 'mxN' (e.g. "
            f"'mx32') or 'AxB' (e.g. '1x128', '128x128').")
    if m.group(2):
        return "mx", int(m.group(2))
    if m.group(3):
        return "block", (int(m.group(3)), int(m.group(4)))
    return spec, None


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """How the three GEMMs of a scaled ``dot_general`` quantize their operands.

    Tilings are given for an operand laid out as ``[free, contraction]``: "1x128" is one
    scale per row and 128 contraction elements; "128x128" a square block; "row" one scale
    per row over the whole contraction; "tensor" one scale; "mx32" OCP MX blocks of 32 with
    E8M0 scales; "none" a plain cast (no scale).

    Attributes:
      name: the recipe's name (for tables and CLIs).
      x_format, w_format, grad_format: element formats of activations, weights, gradients.
      x_tile, w_tile, grad_tile: tilings (the same tiling is applied along whichever axis a
        GEMM contracts, so x is re-quantized 128x1 for the weight gradient under "1x128").
      delayed: per-tensor scales from an amax history (needs an ``Fp8DotState``).
      history, amax_algo, margin: delayed-scaling parameters (Transformer Engine's defaults).
      power_of_two: round scales up to powers of two (DeepGEMM's ``ceil_to_ue8m0``).
      mx_scale_rounding: the MX scale rule (see ``fmtkit.MXScaling``); "rceil" is what
        cuBLAS and Transformer Engine use (no element overflow).
      accum_mantissa_bits: if set, emulate an accumulator with this many mantissa bits
        (Hopper FP8 tensor cores keep about 14 bits, DeepSeek-V3 section 3.3.2), promoting
        into f32 every ``promote_every`` elements of the contraction (N_C = 128).
      use_kernel: "auto" calls the Pallas blockwise kernel (``pallas_kernels``) for every
        GEMM whose operands fit it (E4M3, 1x128 x 128x128 or 1x128 x 1x128: all three GEMMs
        of "blockwise") on a Hopper GPU, and the jitted pure-JAX path (same semantics)
        elsewhere; "never" always the pure-JAX path; "interpret" the kernel in GPU-interpret
        mode (CPU tests).
      amax_reduce_axes: mesh axis names to take per-tensor amaxes over (``lax.pmax``) when
        the dot runs inside ``shard_map`` on a shard of the tensor, so every device uses the
        global scale. Under ``jax.jit`` with shardings leave it empty: reductions there are
        already global. Block scales need no reduction (they shard with their blocks).
    """

    name: str = "custom"
    x_format: str = "e4m3"
    w_format: str = "e4m3"
    grad_format: str = "e5m2"
    x_tile: str = "tensor"
    w_tile: str = "tensor"
    grad_tile: str = "tensor"
    delayed: bool = False
    history: int = 1024
    amax_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    power_of_two: bool = False
    mx_scale_rounding: Literal["floor", "ceil", "even", "rceil"] = "rceil"
    accum_mantissa_bits: int | None = None
    promote_every: int | None = 128
    use_kernel: Literal["auto", "never", "interpret"] = "auto"
    amax_reduce_axes: tuple[str, ...] = ()

    def __post_init__(self):
        for arg in ("x_format", "w_format", "grad_format"):
            fmt = get_format(getattr(self, arg))
            if fmt.bits > 8:
                raise ValueError(f"{arg}={getattr(self, arg)!r} is not an FP8/FP6/FP4 format; "
                                 "use a Policy for bf16/fp16 compute.")
        tiles = {a: _parse_tile(getattr(self, a), a) for a in ("x_tile", "w_tile", "grad_tile")}
        if self.delayed and any(k != "tensor" for k, _ in tiles.values()):
            raise ValueError("delayed=True needs per-tensor tiles ('tensor') for x, w and grad.")
        if tiles["grad_tile"][0] == "none" and get_format(self.grad_format).max < 57344.0:
            raise ValueError(
                f"grad_format={self.grad_format!r} has max "
                f"{get_format(self.grad_format).max:g}: unscaled gradients need E5M2's range "
                "(57344) or a scaled grad_tile.")
        DelayedScaling(self.history, self.amax_algo, self.margin)  # validates those fields
        if self.accum_mantissa_bits is not None and not 1 <= self.accum_mantissa_bits <= 23:
            raise ValueError(
                f"accum_mantissa_bits must be in [1, 23], got {self.accum_mantissa_bits}.")
        if self.promote_every is not None and self.promote_every <= 0:
            raise ValueError(f"promote_every must be positive or None, got {self.promote_every}.")
        if self.use_kernel not in ("auto", "never", "interpret"):
            raise ValueError("use_kernel must be 'auto', 'never' or 'interpret', got "
                             f"{self.use_kernel!r}.")
        if not isinstance(self.amax_reduce_axes, tuple) or not all(
                isinstance(a, str) for a in self.amax_reduce_axes):
            raise TypeError("amax_reduce_axes must be a tuple of mesh axis names, got "
                            f"{self.amax_reduce_axes!r}.")

    def __str__(self) -> str:
        return self.name


RECIPES: dict[str, FP8Recipe] = {
    "current": FP8Recipe("current"),
    "delayed": FP8Recipe("delayed", delayed=True),
    "rowwise": FP8Recipe("rowwise", x_tile="row", w_tile="row", grad_tile="row"),
    "blockwise": FP8Recipe("blockwise", grad_format="e4m3", x_tile="1x128",
                           w_tile="128x128", grad_tile="1x128"),
    "mxfp8": FP8Recipe("mxfp8", grad_format="e4m3", x_tile="mx32", w_tile="mx32",
                       grad_tile="mx32"),
}
"""The named recipes (see the module docstring)."""


def get_recipe(recipe: str | FP8Recipe) -> FP8Recipe:
    """Returns the recipe for a name (or the recipe itself); the error lists the names."""
    if isinstance(recipe, FP8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"Unknown FP8 recipe {recipe!r}; valid names: {', '.join(RECIPES)}.")


# ---------------------------------------------------------------------------------------------
# Delayed-scaling state: one amax history per operand role (x, w, grad) of one dot.


class Fp8DotState(NamedTuple):
    """Delayed-scaling state of one scaled dot: histories of x, w and gradient amaxes.

    Attributes:
      amax_history: f32[3, history]; rows are x, w, grad; column 0 is the newest entry.
        While a row is all zeros (before the first step) the current amax is used instead:
        the bootstrap that Flax's recipe lacks. (No integer counter, so ``jax.grad`` can
        take the whole state.)

    The gradient amax is only known in the backward pass, so the dot reports all three
    observed amaxes as the *cotangent* of ``amax_history`` (column 0; zeros elsewhere):
    differentiate the loss with respect to the state too and pass that "gradient" to
    ``update_state``. Never hand it to an optimizer.
    """

    amax_history: jax.Array


def init_state(recipe: str | FP8Recipe = "delayed") -> Fp8DotState:
    """A fresh (empty-history) state for one dot."""
    recipe = get_recipe(recipe)
    return Fp8DotState(jnp.zeros((3, recipe.history), jnp.float32))


def combine_observations(a: Any, b: Any) -> Any:
    """Combines two micro-batches' observed-amax trees with ``max`` (gradient accumulation)."""
    return jax.tree.map(jnp.maximum, a, b)


def update_state(state: Any, observed: Any) -> Any:
    """Records observed amaxes into every amax history of a tree (one step).

    Args:
      state: a pytree of amax histories: ``Fp8DotState`` nodes, or a Flax ``"fp8_state"``
        collection (every leaf an f32[3, history] array).
      observed: the gradient of the loss with respect to ``state`` (same structure): each
        dot's observed x / w / grad amaxes sit in column 0 of its history. Combine
        micro-batches with ``combine_observations`` (max) before calling this once per step.

    Returns:
      The state with each history rolled by one and the observations recorded; a dot whose
      observations are not all finite keeps its history unchanged.
    """
    def upd(hist, obs):
        amax = obs[:, 0].astype(hist.dtype)
        rolled = jnp.roll(hist, 1, axis=1).at[:, 0].set(amax)
        # A step with a non-finite amax (an overflow that loss scaling will skip) is not
        # recorded: an inf in the history would poison the scale for `history` steps.
        return jnp.where(jnp.all(jnp.isfinite(amax)), rolled, hist)

    return jax.tree.map(upd, state, observed)


# ---------------------------------------------------------------------------------------------
# Quantizing a [free, contraction] operand and the blockwise-promoted GEMM.


def _tile_recipe(spec: str, recipe: FP8Recipe, shape: tuple[int, int], role: str):
    kind, arg = _parse_tile(spec, role)
    f, c = shape
    if kind == "tensor":
        return TensorScaling(recipe.power_of_two, recipe.margin)
    if kind == "row":
        return AxisScaling(-1, recipe.power_of_two, recipe.margin)
    if kind == "none":
        return None
    if kind == "mx":
        if c % arg:
            raise ValueError(f"contraction size {c} of {role} is not divisible by the MX block "
                             f"{arg} (recipe {recipe.name!r}).")
        return MXScaling(arg, recipe.mx_scale_rounding, axis=-1)
    bf, bc = arg
    if c % bc:
        raise ValueError(f"contraction size {c} of {role} is not divisible by the recipe's "
                         f"block {bc} (recipe {recipe.name!r}, tile {spec}).")
    if f % bf:
        raise ValueError(f"size {f} of {role}'s non-contracted dims is not divisible by the "
                         f"recipe's block {bf} (recipe {recipe.name!r}, tile {spec}).")
    return BlockScaling((bf, bc), recipe.power_of_two, recipe.margin)


def _quantize_operand(t: jax.Array, fmt: str, spec: str, recipe: FP8Recipe, role: str,
                      delayed_amax: jax.Array | None) -> ScaledArray:
    """Quantizes a 2-D [free, contraction] operand per the tiling."""
    if delayed_amax is not None:
        # Per-tensor with a given amax (history or current): DelayedScaling semantics, which
        # equal TensorScaling's for the same amax.
        d = DelayedScaling(1, "max", recipe.margin, recipe.power_of_two)
        state = DelayedScalingState(delayed_amax.reshape(1), jnp.ones((), jnp.int32))
        return quantize(t, fmt, d, state=state)
    scaling = _tile_recipe(spec, recipe, t.shape, role)
    if scaling is None:
        f = get_format(fmt)
        values = jnp.clip(t.astype(jnp.float32), -f.max, f.max).astype(f.dtype)
        return ScaledArray(values, jnp.ones((1, 1), jnp.float32), f, TensorScaling())
    return quantize(t, fmt, scaling)


def _expand_scale(sa: ScaledArray, g: int) -> jax.Array:
    """Scale as f32 [F, C / g]: repeated along the free dim and over g-blocks of C."""
    s = sa.scale.astype(jnp.float32)
    f, c = sa.values.shape
    bf, bc = sa.block
    if bf > 1:
        s = jnp.repeat(s, bf, axis=0)
    if bc > g:
        s = jnp.repeat(s, bc // g, axis=1)
    return jnp.broadcast_to(s, (f, c // g))


def _truncate_mantissa(x: jax.Array, bits: int) -> jax.Array:
    """Rounds f32 toward zero to ``bits`` mantissa bits (an accumulator's register width)."""
    mask = jnp.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)


def limited_precision_matmul(a: jax.Array, b: jax.Array, *, mantissa_bits: int,
                             promote_every: int | None = 128) -> jax.Array:
    """``a [M, C] · b [N, C]ᵀ`` with an emulated limited-precision accumulator.

    Products are exact in f32 (FP8 x FP8 needs 8 bits); the running sum is truncated to
    ``mantissa_bits`` after every addition, and every ``promote_every`` elements of C it is
    added into an f32 accumulator and restarted (DeepSeek-V3's promotion; None: never).
    Sequential over C, so meant for studies and tests, not training-size GEMMs.
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    m, c = a.shape
    n = b.shape[0]
    chunk = c if promote_every is None else promote_every
    if c % chunk:
        raise ValueError(f"contraction size {c} is not divisible by promote_every={chunk}.")

    def chunk_sum(carry, ab):
        ac, bc = ab  # [M, chunk], [N, chunk]

        def step(acc, k):
            prod = ac[:, k][:, None] * bc[:, k][None, :]
            return _truncate_mantissa(acc + prod, mantissa_bits), None

        part, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(chunk))
        return carry + part, None

    a_chunks = a.reshape(m, c // chunk, chunk).transpose(1, 0, 2)
    b_chunks = b.reshape(n, c // chunk, chunk).transpose(1, 0, 2)
    out, _ = lax.scan(chunk_sum, jnp.zeros((m, n), jnp.float32), (a_chunks, b_chunks))
    return out


def scaled_matmul(a: ScaledArray, b: ScaledArray, recipe: FP8Recipe | None = None
                  ) -> jax.Array:
    """f32 ``a [F1, C] · b [F2, C]ᵀ`` of two quantized operands, scales applied per C-block.

    Raises:
      ValueError: mismatched contraction sizes.
    """
    fa, c = a.values.shape
    fb, cb = b.values.shape
    if c != cb:
        raise ValueError(f"contraction sizes differ: a has {c}, b has {cb}.")
    g = min(a.block[1], b.block[1])
    nb = c // g
    acc_bits = recipe.accum_mantissa_bits if recipe is not None else None
    sa, sb = _expand_scale(a, g), _expand_scale(b, g)
    if acc_bits is not None:
        if recipe.promote_every is not None and recipe.promote_every % g and g % (
                recipe.promote_every):
            raise ValueError(f"promote_every={recipe.promote_every} must divide or be a "
                             f"multiple of the scale block {g}.")
        # Emulation: dequantize per element (exact products), accumulate in the limited
        # register; scales are folded into the operands, equivalent up to f32 round-off.
        av = a.values.astype(jnp.float32) * jnp.repeat(sa, g, axis=1)
        bv = b.values.astype(jnp.float32) * jnp.repeat(sb, g, axis=1)
        return limited_precision_matmul(av, bv, mantissa_bits=acc_bits,
                                        promote_every=recipe.promote_every)
    if nb == 1:
        out = lax.dot_general(a.values, b.values, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
        return out * sa[:, 0][:, None] * sb[:, 0][None, :]
    av = a.values.reshape(fa, nb, g)
    bv = b.values.reshape(fb, nb, g)
    parts = lax.dot_general(av, bv, (((2,), (2,)), ((1,), (1,))),
                            preferred_element_type=jnp.float32)  # [nb, F1, F2]
    # Promotion: scale each f32 partial product by its blocks' scales, then sum over blocks
    # (elementwise, not an f32 dot, so every GEMM in the jaxpr stays FP8).
    return jnp.sum(parts * sa.T[:, :, None] * sb.T[:, None, :], axis=0)


def _kernel_impl(recipe: FP8Recipe, a: ScaledArray, b: ScaledArray) -> str | None:
    """The Pallas kernel's ``impl`` for this GEMM, or None for the pure-JAX path.

    The kernel takes E4M3 ``a`` in 1x128 tiles and ``b`` in 128x128 blocks or 1x128 tiles:
    the three GEMMs of the "blockwise" recipe. Whether the GPU is a Hopper is decided in one
    place, ``pallas_kernels`` (imported only when the operands fit).
    """
    if recipe.use_kernel == "never" or recipe.accum_mantissa_bits is not None:
        return None
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        return None
    if a.fmt.name != "float8_e4m3fn" or b.fmt.name != "float8_e4m3fn":
        return None
    if recipe.use_kernel == "interpret":
        return "interpret"
    from pallas_kernels import _backend

    return "kernel" if _backend.is_hopper() else None


def _gemm(a: ScaledArray, b: ScaledArray, recipe: FP8Recipe) -> jax.Array:
    impl = _kernel_impl(recipe, a, b)
    if impl is not None:
        import pallas_kernels

        return pallas_kernels.blockwise_fp8_matmul(a.values, a.scale, b.values, b.scale,
                                                   out_dtype=jnp.float32, impl=impl)
    return scaled_matmul(a, b, recipe)


# ---------------------------------------------------------------------------------------------
# The custom-VJP core on 2-D operands: x [M, K], w [N, K] (K-major), y [M, N].


def _history_amax(recipe: FP8Recipe, hist: jax.Array, current: jax.Array) -> jax.Array:
    past = jnp.max(hist) if recipe.amax_algo == "max" else hist[0]
    return jnp.where(jnp.all(hist == 0), current, past)


def _amax(t: jax.Array, recipe: FP8Recipe) -> jax.Array:
    amax = jnp.max(jnp.abs(t.astype(jnp.float32)))
    for axis in recipe.amax_reduce_axes:
        amax = lax.pmax(amax, axis)
    return amax


def _tensor_amax(recipe: FP8Recipe, spec: str, hist_row: jax.Array, current: jax.Array
                 ) -> jax.Array | None:
    """The amax a per-tensor operand is quantized with (history for delayed recipes, else the
    current, possibly mesh-reduced, amax); None for other tilings (they use their blocks)."""
    if recipe.delayed:
        return _history_amax(recipe, hist_row, current)
    return current if _parse_tile(spec, "tile")[0] == "tensor" else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(recipe: FP8Recipe, x: jax.Array, w: jax.Array, hist: jax.Array) -> jax.Array:
    return _core_fwd(recipe, x, w, hist)[0]


def _core_fwd(recipe, x, w, hist):
    amax_x, amax_w = _amax(x, recipe), _amax(w, recipe)
    dx = _tensor_amax(recipe, recipe.x_tile, hist[0], amax_x)
    dw = _tensor_amax(recipe, recipe.w_tile, hist[1], amax_w)
    xq = _quantize_operand(x, recipe.x_format, recipe.x_tile, recipe, "x", dx)
    wq = _quantize_operand(w, recipe.w_format, recipe.w_tile, recipe, "w", dw)
    y = _gemm(xq, wq, recipe)
    return y, (x, w, hist, amax_x, amax_w)


def _core_bwd(recipe, res, g):
    x, w, hist, amax_x, amax_w = res
    amax_g = _amax(g, recipe)
    d_g = _tensor_amax(recipe, recipe.grad_tile, hist[2], amax_g)
    d_x = _tensor_amax(recipe, recipe.x_tile, hist[0], amax_x)
    d_w = _tensor_amax(recipe, recipe.w_tile, hist[1], amax_w)
    # dgrad: dx [M, K] = g [M, N] · w [N, K], contracting N.
    gq_n = _quantize_operand(g, recipe.grad_format, recipe.grad_tile, recipe, "grad", d_g)
    wq_n = _quantize_operand(w.T, recipe.w_format, recipe.w_tile, recipe, "w", d_w)
    dx = _gemm(gq_n, wq_n, recipe).astype(x.dtype)
    # wgrad: dw [N, K] = gᵀ [N, M] · x [M, K], contracting the tokens M.
    gq_m = _quantize_operand(g.T, recipe.grad_format, recipe.grad_tile, recipe, "grad", d_g)
    xq_m = _quantize_operand(x.T, recipe.x_format, recipe.x_tile, recipe, "x", d_x)
    dw = _gemm(gq_m, xq_m, recipe).astype(w.dtype)
    observed = jnp.zeros_like(hist).at[:, 0].set(jnp.stack([amax_x, amax_w, amax_g]))
    return dx, dw, observed


_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# lax.dot_general's signature.


def _canonicalize(lhs, rhs, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) % a.ndim for d in ds)
                      for ds, a in ((lc, lhs), (rc, rhs), (lb, lhs), (rb, rhs)))
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = [lhs.shape[d] for d in lb]
    m = math.prod(lhs.shape[d] for d in lf)
    n = math.prod(rhs.shape[d] for d in rf)
    k = math.prod(lhs.shape[d] for d in lc)
    x = lhs.transpose(*lb, *lf, *lc).reshape(*batch, m, k)
    w = rhs.transpose(*rb, *rf, *rc).reshape(*batch, n, k)
    out_shape = (*batch, *(lhs.shape[d] for d in lf), *(rhs.shape[d] for d in rf))
    return x, w, len(batch), out_shape


def dot_general(recipe: str | FP8Recipe = "blockwise"):
    """Returns a function with ``lax.dot_general``'s signature that computes in FP8.

    Plugs into ``nn.Dense(dot_general=...)``, ``nn.DenseGeneral``, ``nn.Einsum`` and
    ``nnx.Linear(dot_general=...)``. Any contracting and batch dims are accepted (they are
    flattened to a 2-D GEMM per batch element). Delayed recipes take their state as the
    keyword ``fp8_state`` (an ``Fp8DotState``); the linen / NNX module wrappers in
    ``fmtkit.policy`` thread it for you.

    Example:
      >>> dg = dot_general("blockwise")
      >>> x, w = jnp.ones((128, 256)), jnp.ones((256, 128))
      >>> dg(x, w, (((1,), (0,)), ((), ()))).shape
      (128, 128)
    """
    recipe = get_recipe(recipe)

    def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, fp8_state: Fp8DotState | None = None,
                        **unused):
        del precision, unused  # FP8 GEMMs accumulate in f32 by construction
        lhs = check_floating(lhs, "lhs")
        rhs = check_floating(rhs, "rhs")
        out_dtype = preferred_element_type or (
            lhs.dtype if lhs.dtype == rhs.dtype else jnp.float32)
        if recipe.delayed:
            if fp8_state is None:
                raise ValueError(f"recipe {recipe.name!r} is delayed: pass fp8_state= (see "
                                 "fmtkit.fp8.init_state) or use the Flax module wrappers.")
            hist = fp8_state.amax_history
        else:
            hist = jnp.zeros((3, 1), jnp.float32)
        x, w, nbatch, out_shape = _canonicalize(lhs, rhs, dimension_numbers)
        if nbatch and recipe.delayed:
            raise ValueError("delayed scaling supports dots without batch dims (Dense, "
                             "DenseGeneral); use a current-scaling recipe for batched einsums.")
        core = functools.partial(_core, recipe)
        for _ in range(nbatch):
            core = jax.vmap(core, in_axes=(0, 0, None))
        y = core(x, w, hist)
        return y.reshape(out_shape).astype(out_dtype)

    fp8_dot_general.recipe = recipe  # type: ignore[attr-defined]
    return fp8_dot_general
