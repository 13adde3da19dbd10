"""The core of the FP8 dot on 2-D operands: x [M, K], w [N, K] (K-major), y [M, N].

Each of the three GEMMs of a linear layer receives real FP8 operands, each quantized along
the axis that GEMM contracts over:

    forward   y  = x  · w      contracts K        x tiles along K, w tiles along K
    dgrad     dx = dy · wᵀ     contracts N        dy tiles along N, w tiles along N
    wgrad     dw = xᵀ · dy     contracts tokens   x and dy tiles along the tokens

Each dimension that a tiling blocks is zero-padded inside the GEMM that needs it and the
result is sliced back, so any shape trains. Quantized operands whose tiling is the same along
both axes (per tensor, unscaled, square blocks) are kept from the forward pass and transposed
for the backward GEMMs: quantizing the transpose would give the same values and scales, so
only the tilings that change with the contraction axis (rows, 1x128 tiles, MX blocks) are
quantized again from x / w / dy.

Forward-mode AD (``jax.jvp``, ``jacfwd``) computes the tangent through the forward GEMM's
quantized operands, ``ẏ = ẋ · Q(w)ᵀ + Q(x) · ẇᵀ`` in f32 (``_operands``); reverse mode
runs the three GEMMs above (see ``fmtkit._lowp.autodiff``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit._lowp.autodiff import differentiable
from fmtkit._lowp.core import Core
from fmtkit._lowp.gemm import DGRAD_SCOPE, WGRAD_SCOPE, gemm, gemm_dtype
from fmtkit._lowp.operands import (
    Operand,
    padded_c,
    quantize_operand,
    round_up,
    transpose_operand,
)
from fmtkit._lowp.recipes import Fp8Recipe, Tile, recipe_tiles
from fmtkit._switches import SWITCHES
from fmtkit.scaling import delayed_amax_of, dequantize


def _amax(t: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    # max |t| in t's own dtype, then f32: exact (|t| and max only pick elements), and a
    # bf16 operand is read once instead of converted into an f32 copy first (on XLA:CPU the
    # f32 form cost a noticeable share of a bf16 model's step).
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    for axis in recipe.amax_reduce_axes:
        amax = lax.pmax(amax, axis)
    return amax


def _tensor_amax(recipe: Fp8Recipe, tile: Tile, hist_row: jax.Array, t: jax.Array,
                 current: jax.Array) -> jax.Array | None:
    """The amax a per-tensor operand ``t`` is quantized with: for delayed recipes its
    history's (``t``'s own amax only before the first recorded step, computed under
    ``lax.cond``: see ``delayed_amax_of``), else ``current`` (possibly mesh-reduced); None for
    other tilings (they use their blocks)."""
    if recipe.delayed:
        return delayed_amax_of(hist_row, t, functools.partial(_amax, recipe=recipe),
                               recipe.amax_algo)
    return current if tile.kind == "tensor" else None



def _used_amax(t: jax.Array, recipe: Fp8Recipe, tile: Tile) -> jax.Array:
    """``_amax(t)`` where a GEMM or the history reads it (a per-tensor tile; a delayed
    recipe's observation), else a zero that nothing reads: a tensor scaled per block or row
    is not read once more for an amax it does not use (one pass over HBM less)."""
    if recipe.delayed or tile.kind == "tensor":
        return _amax(t, recipe)
    return jnp.zeros((), jnp.float32)


def _forward(recipe, out_dtype, x, w, hist):
    tx, tw, _ = recipe_tiles(recipe)
    m, k = x.shape
    n = w.shape[0]
    # w.T (here and for the delayed bootstrap): w is usually the transpose of a [K, N]
    # kernel (``_dot._canonicalize``), and a max over all elements is order-free: reducing the
    # un-transposed kernel avoids a transposed copy.
    amax_x, amax_w = _used_amax(x, recipe, tx), _used_amax(w.T, recipe, tw)
    kp = padded_c(k, tx, tw)
    xq = quantize_operand(x, recipe.x_format, tx, recipe,
                  _tensor_amax(recipe, tx, hist[0], x, amax_x), kp)
    # w is quantized as w.T [K, N] (contraction-major: see Operand), the kernel's layout.
    wq = quantize_operand(w.T, recipe.w_format, tw, recipe,
                  _tensor_amax(recipe, tw, hist[1], w.T, amax_w), kp, cmajor=True)
    y = gemm(xq, wq, recipe, gemm_dtype(out_dtype))[:m, :n]
    # Residuals: the quantized operand where the backward GEMMs can reuse it, else the input.
    # (Empty arrays carry K and the input dtypes: residuals must be arrays.)
    reuse = SWITCHES.reuse_quantized_operands
    return y, (xq if reuse and tx.transposable else x, wq if reuse and tw.transposable else w,
               hist, amax_x, amax_w, jnp.zeros((0, k), x.dtype), jnp.zeros((0,), w.dtype))


def _backward_operand(res: jax.Array | Operand, fmt: str, tile: Tile,
                      recipe: Fp8Recipe, hist_row: jax.Array, amax: jax.Array, k: int,
                      c_to: int, *, stored_transposed: bool) -> Operand:
    """A forward operand ([F, K], saved by ``_forward``) as a backward GEMM reads it,
    contracting F: its quantized forward value transposed where the tile allows, else the
    saved input re-quantized along the new contraction (padded to ``c_to`` columns), in the
    layout it is stored in: ``stored_transposed`` (w, the transpose of a [K, N] kernel) is
    quantized from ``res.T``, otherwise (x [M, K]) ``res`` is quantized contraction-major."""
    if isinstance(res, Operand):  # (saved quantized: the tile is transposable)
        return transpose_operand(res, round_up(k, tile.f), c_to)
    amax = _tensor_amax(recipe, tile, hist_row, res, amax)
    if stored_transposed:
        return quantize_operand(res.T, fmt, tile, recipe, amax, c_to)
    return quantize_operand(res, fmt, tile, recipe, amax, c_to, cmajor=True)


def _backward(recipe, out_dtype, res, g, need):
    del out_dtype, need  # (a gradient nothing reads is dead code in a compiled step)
    g = g.astype(jnp.float32)  # as when the forward GEMM returned f32 (exact from bf16)
    x_res, w_res, hist, amax_x, amax_w, x_meta, w_meta = res
    m, n = g.shape
    k, x_dtype, w_dtype = x_meta.shape[1], x_meta.dtype, w_meta.dtype
    tx, tw, tg = recipe_tiles(recipe)
    amax_g = _used_amax(g, recipe, tg)
    d_g = _tensor_amax(recipe, tg, hist[2], g, amax_g)
    # dgrad: dx [M, K] = g [M, N] · w [N, K], contracting N.
    np_ = padded_c(n, tg, tw)
    gq_n = quantize_operand(g, recipe.grad_format, tg, recipe, d_g, np_)
    wq_n = _backward_operand(w_res, recipe.w_format, tw, recipe, hist[1], amax_w, k, np_,
                             stored_transposed=True)
    with jax.named_scope(DGRAD_SCOPE):
        dx = gemm(gq_n, wq_n, recipe, gemm_dtype(x_dtype))[:m, :k].astype(x_dtype)
    # wgrad: dw [N, K] = gᵀ [N, M] · x [M, K], contracting the tokens M.
    mp = padded_c(m, tg, tx)
    if SWITCHES.reuse_quantized_operands and tg.transposable and tg.kind != "block":
        # per tensor / unscaled: the dgrad operand, transposed (square blocks would need the
        # same padding along M and N; re-quantizing g is as cheap as padding it again)
        gq_m = transpose_operand(gq_n, round_up(n, tg.f), mp)
    else:
        gq_m = quantize_operand(g, recipe.grad_format, tg, recipe, d_g, mp, cmajor=True)
    xq_m = _backward_operand(x_res, recipe.x_format, tx, recipe, hist[0], amax_x, k, mp,
                             stored_transposed=False)
    # Computed as dwᵀ [K, N]: the kernel's layout when w was given as [K, N] (a Dense
    # kernel), so the transpose back cancels with the dot's canonical form's.
    with jax.named_scope(WGRAD_SCOPE):
        dw = gemm(gq_m, xq_m, recipe, transposed=True)[:k, :n].astype(w_dtype).T
    observed = jnp.zeros_like(hist)  # only a delayed recipe's history observes the amaxes
    if recipe.delayed:  # (elsewhere a per-shard amax under shard_map would not type-check)
        observed = observed.at[:, 0].set(jnp.stack([amax_x, amax_w, amax_g]))
    return dx, dw, observed


def _forward_operand(res: jax.Array | Operand, fmt: str, tile: Tile, recipe: Fp8Recipe,
                     hist_row: jax.Array, amax: jax.Array, f: int, k: int, *,
                     stored_transposed: bool) -> jax.Array:
    """A forward operand [F, K] as the forward GEMM read it, dequantized to f32: from its
    saved quantized value, or quantized again from the saved input as ``_forward`` did."""
    if not isinstance(res, Operand):
        kp = padded_c(k, *recipe_tiles(recipe)[:2])
        t = res.T if stored_transposed else res
        res = quantize_operand(t, fmt, tile, recipe, _tensor_amax(recipe, tile, hist_row, t,
                                                                   amax), kp,
                               cmajor=stored_transposed)
    return dequantize(res.logical(), jnp.float32)[:f, :k]


def _operands(recipe, res, m, n):
    """``Q(x)`` [M, K] and ``Q(w)`` [N, K], the forward GEMM's operands as it multiplied them
    (dequantized, f32), from ``_forward``'s residuals: the forward-mode tangent's operands
    (see ``fmtkit._lowp.autodiff``)."""
    x_res, w_res, hist, amax_x, amax_w, x_meta, _ = res
    tx, tw, _ = recipe_tiles(recipe)
    k = x_meta.shape[1]
    xd = _forward_operand(x_res, recipe.x_format, tx, recipe, hist[0], amax_x, m, k,
                          stored_transposed=False)
    wd = _forward_operand(w_res, recipe.w_format, tw, recipe, hist[1], amax_w, n, k,
                          stored_transposed=True)
    return xd, wd


FP8_CORE = Core(forward=_forward, backward=_backward, operands=_operands)
"""The FP8 core's functions (``fmtkit._lowp.core.Core``)."""

fp8_dot = differentiable(FP8_CORE, """\
``x [M, K] · w [N, K]ᵀ`` with the recipe's three GEMMs; ``hist`` f32[3, history] is the
delayed recipe's amax history (its cotangent: the observed amaxes). Forward-mode AD: see
``fmtkit._lowp.autodiff.differentiable``.""")
