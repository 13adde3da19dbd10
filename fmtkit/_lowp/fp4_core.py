"""The core of the FP4 dot (``Fp4Recipe``), on the FP8 dot's 2-D operands
x [M, K], w [N, K] (K-major), y [M, N], and ``quantization_stats``.

The per-GEMM recipe (forward, dgrad, wgrad with the random Hadamard transform), the
stochastic-rounding keys and the emulation are described in ``fmtkit.fp4``'s module
docstring, the public path of these names. Each operand of a GEMM is zero-padded to its
blocks along both dims (exact: zeros never raise an amax, a zero block has scale 0 and zero
values) and the result sliced back, as in the FP8 core.

Forward-mode AD computes the tangent through the forward GEMM's quantized operands,
``ẏ = ẋ · Q(w)ᵀ + Q(x) · ẇᵀ`` in f32 (``_operands``), as the FP8 core does; reverse mode
runs the backward GEMMs (see ``fmtkit._lowp.autodiff``).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit._lowp.autodiff import differentiable
from fmtkit._lowp.backends import on_blackwell
from fmtkit._lowp.core import Core
from fmtkit._lowp.fp4_quant import (
    E2M1_MAX,
    E4M3,
    Fp4Array,
    mxfp4_quantize,
    nvfp4_quantize,
    tensor_amax,
)
from fmtkit._lowp.gemm import DGRAD_SCOPE, WGRAD_SCOPE, scaled_matmul
from fmtkit._lowp.hadamard import random_hadamard_transform
from fmtkit._lowp.operands import pad2, padded_c, round_up
from fmtkit._lowp.recipes import Fp4Recipe, get_recipe, recipe_tiles, tile_of
from fmtkit.casting import check_floating
from fmtkit.scaling import ScaledArray
from fmtkit.stats import block_stats


def _sr_key(recipe: Fp4Recipe, t: jax.Array, role: int) -> jax.Array:
    """A PRNG key from the seed, the operand's role and a 32-bit hash of its bits."""
    bits = lax.bitcast_convert_type(t.astype(jnp.float32), jnp.uint32).reshape(-1)
    weights = lax.iota(jnp.uint32, bits.size) * jnp.uint32(2654435761) | jnp.uint32(1)
    h = jnp.sum((bits ^ (bits >> 15)) * weights, dtype=jnp.uint32)
    # The seed's and role's key is a constant: folded at trace time, so the compiled step
    # holds one threefry loop fewer per SR quantization (same key, same stream).
    with jax.ensure_compile_time_eval():
        key = jax.random.fold_in(jax.random.key(recipe.sr_seed), role)
    return jax.random.fold_in(key, h)


def _quantize_operand(t: jax.Array, recipe: Fp4Recipe, operand: str, key_role: int
                      ) -> Fp4Array:
    """Quantizes a padded 2-D ``[free, contraction]`` operand with the tile and rounding of
    the recipe's ``operand`` ("x", "w" or "grad"); ``key_role`` picks its SR key."""
    tile = tile_of(getattr(recipe, f"{operand}_tile"))
    rounding = getattr(recipe, f"{operand}_rounding")
    key = _sr_key(recipe, t, key_role) if rounding == "stochastic" else None
    if recipe.block_scale == "e8m0":
        return mxfp4_quantize(t, tile.c, scale_rounding=recipe.mx_scale_rounding,
                              rounding=rounding, key=key)
    amax = None
    if recipe.amax_reduce_axes:
        amax = tensor_amax(t)
        for axis in recipe.amax_reduce_axes:
            amax = lax.pmax(amax, axis)
    return nvfp4_quantize(t, (tile.f, tile.c), rounding=rounding, key=key, amax=amax)


def _padded_operand(t: jax.Array, recipe: Fp4Recipe, operand: str, c_to: int, key_role: int
                    ) -> Fp4Array:
    """``t`` [F, C] zero-padded to its free block and to ``c_to`` columns, quantized as the
    recipe's ``operand``."""
    f = tile_of(getattr(recipe, f"{operand}_tile")).f
    return _quantize_operand(pad2(t, round_up(t.shape[0], f), c_to), recipe, operand, key_role)



def _uses_scaled_matmul(recipe: Fp4Recipe, a: Fp4Array, b: Fp4Array) -> bool:
    """Whether this GEMM runs through ``jax.nn.scaled_matmul``: NVFP4 operands on a Blackwell
    GPU ("auto"), or anywhere with ``use_kernel="interpret"`` (JAX's own decomposition)."""
    if recipe.use_kernel == "never" or recipe.block_scale != "e4m3":
        return False
    return recipe.use_kernel == "interpret" or on_blackwell()


GEMM_SCOPE = "fmtkit_fp4"
"""Prefix of the named scope around every FP4 GEMM, ``fmtkit_fp4_<a block>_<b block>`` (e.g.
``fmtkit_fp4_1x16_16x16``: each operand's block shape over its [free, contraction] dims), so
a jaxpr reader (``fmtkit.policy.inspect_policy``) reports the GEMM's operands as E2M1 with
their blocks: the emulation's dot takes them widened, exactly, to E4M3."""


def _gemm_scope(a: Fp4Array, b: Fp4Array) -> str:
    """The named scope of the GEMM of ``a`` and ``b`` (``GEMM_SCOPE``)."""
    return "_".join([GEMM_SCOPE, *("x".join(map(str, t.block[-2:])) for t in (a, b))])


def _gemm(a: Fp4Array, b: Fp4Array, recipe: Fp4Recipe) -> jax.Array:
    """f32 ``a [F1, C] · b [F2, C]ᵀ`` of two FP4 operands (see ``fmtkit.fp4``'s module
    docstring)."""
    with jax.named_scope(_gemm_scope(a, b)):
        return _gemm_body(a, b, recipe)


def _gemm_body(a: Fp4Array, b: Fp4Array, recipe: Fp4Recipe) -> jax.Array:
    alpha = a.tensor_scale * b.tensor_scale
    if _uses_scaled_matmul(recipe, a, b):
        # cuDNN's NVFP4 layout: 1x16 scales along C; a 16x16 block's scale repeats per row.
        sa = jnp.repeat(a.block_scale, a.block[0], axis=0) if a.block[0] > 1 else a.block_scale
        sb = jnp.repeat(b.block_scale, b.block[0], axis=0) if b.block[0] > 1 else b.block_scale
        out = jax.nn.scaled_matmul(a.values[None], b.values[None], sa[None], sb[None],
                                   preferred_element_type=jnp.float32)[0]
        return out * alpha
    # Emulation: E2M1 -> E4M3 is exact; XLA cannot dot E2M1 off Blackwell.
    wide = [ScaledArray(t.values.astype(jnp.float8_e4m3fn), t.block_scale.astype(jnp.float32),
                        E4M3, None) for t in (a, b)]
    return scaled_matmul(*wide) * alpha


def _transpose(q: Fp4Array, f_to: int, c_to: int) -> Fp4Array:
    """The transpose of a square-blocked operand, zero-padded (zero blocks) to [f_to, c_to]."""
    bf = q.block[1]
    v = pad2(q.values.T, f_to, c_to)
    s = pad2(q.block_scale.T, f_to // bf, c_to // bf)
    return Fp4Array(v, s, q.tensor_scale, q.block[::-1])


def _core_impl(recipe, x, w):
    m, k = x.shape
    n = w.shape[0]
    tx, tw, _ = recipe_tiles(recipe)
    kp = padded_c(k, tx, tw)
    xq = _padded_operand(x, recipe, "x", kp, 0)
    wq = _padded_operand(w, recipe, "w", kp, 1)
    return _gemm(xq, wq, recipe)[:m, :n], wq


def _forward(recipe, out_dtype, x, w, hist):
    y, wq = _core_impl(recipe, x, w)
    square = tile_of(recipe.w_tile).f > 1
    return y, (x, w, wq if square else None, hist)


def _backward(recipe, out_dtype, res, g, need):
    del out_dtype, need  # (a gradient nothing reads is dead code in a compiled step)
    x, w, wq, hist = res
    m, k = x.shape
    n = w.shape[0]
    tx, tw, tg = recipe_tiles(recipe)
    # dgrad: dx [M, K] = g [M, N] · w [N, K], contracting N; the weight's 2D blocks transposed.
    np_ = padded_c(n, tg, tw)
    gq = _padded_operand(g, recipe, "grad", np_, 2)
    if wq is not None:
        wq_n = _transpose(wq, wq.values.shape[1], np_)
    else:
        wq_n = _padded_operand(w.T, recipe, "w", np_, 1)
    with jax.named_scope(DGRAD_SCOPE):
        dx = _gemm(gq, wq_n, recipe)[:m, :k].astype(x.dtype)
    # wgrad: dw [N, K] = gᵀ [N, M] · x [M, K], contracting the tokens M, both rotated.
    mp = round_up(m, math.lcm(tg.c, tx.c, recipe.rht_size if recipe.rht else 1))
    a = pad2(g.T, round_up(n, tg.f), mp)
    b = pad2(x.T, round_up(k, tx.f), mp)
    if recipe.rht:
        a = random_hadamard_transform(a, seed=recipe.rht_seed, size=recipe.rht_size)
        b = random_hadamard_transform(b, seed=recipe.rht_seed, size=recipe.rht_size)
    aq = _quantize_operand(a, recipe, "grad", 3)
    bq = _quantize_operand(b, recipe, "x", 4)
    with jax.named_scope(WGRAD_SCOPE):
        dw = _gemm(aq, bq, recipe)[:n, :k].astype(w.dtype)
    return dx, dw, jnp.zeros_like(hist)


def _operands(recipe, res, m, n):
    """``Q(x)`` [M, K] and ``Q(w)`` [N, K], the forward GEMM's FP4 operands as it multiplied
    them (stochastic rounding with its keys included; dequantized, f32), from ``_forward``'s
    residuals: the forward-mode tangent's operands (see ``fmtkit._lowp.autodiff``)."""
    x, w, wq, _ = res
    k = x.shape[1]
    tx, tw, _ = recipe_tiles(recipe)
    kp = padded_c(k, tx, tw)
    xd = _padded_operand(x, recipe, "x", kp, 0).dequantize()[:m, :k]
    if wq is None:
        wq = _padded_operand(w, recipe, "w", kp, 1)
    return xd, wq.dequantize()[:n, :k]


FP4_CORE = Core(forward=_forward, backward=_backward, operands=_operands)
"""The FP4 core's functions (``fmtkit._lowp.core.Core``)."""

fp4_dot = differentiable(FP4_CORE, """\
The FP8 core's signature (``fp8_dot``); the emulated GEMMs return f32 (``out_dtype``, the
consumer's dtype, is applied by the caller). Forward-mode AD: see
``fmtkit._lowp.autodiff.differentiable``.""")


def quantization_stats(t: jax.typing.ArrayLike, recipe: str | Fp4Recipe = "nvfp4",
                       operand: Literal["x", "w", "grad"] = "x") -> dict[str, jax.Array]:
    """What one GEMM operand loses to a recipe's FP4 quantization: ``fmtkit.stats.BLOCK_STATS``
    of ``t`` (``[free, contraction]``) quantized as its GEMM does. Public as
    ``fmtkit.fp4.quantization_stats``, whose docstring says more."""
    recipe = get_recipe(recipe)
    if not isinstance(recipe, Fp4Recipe):
        raise TypeError(f"quantization_stats needs an FP4 recipe, got {recipe.name!r}.")
    if operand not in ("x", "w", "grad"):
        raise ValueError(f"operand must be 'x', 'w' or 'grad', got {operand!r}.")
    t = check_floating(t, "t").astype(jnp.float32)
    if t.ndim != 2:
        raise ValueError(f"t must be 2-D [free, contraction], got shape {t.shape}.")
    tile = tile_of(getattr(recipe, f"{operand}_tile"))
    t = pad2(t, round_up(t.shape[0], tile.f), round_up(t.shape[1], tile.c))
    q = _quantize_operand(t, recipe, operand, {"x": 0, "w": 1, "grad": 2}[operand])
    dec = q.block_scale.astype(jnp.float32) * q.tensor_scale  # decode scale per block
    return block_stats(t, q.dequantize(), dec, E2M1_MAX)
