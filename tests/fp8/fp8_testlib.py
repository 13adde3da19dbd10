"""Shared builders of the FP8 tests: data, the scaled dot's three GEMMs, and the float64
NumPy + ml_dtypes reference of the recipes' quantization.

References are independent: float64 NumPy products of the unquantized inputs (accuracy),
and a float64 NumPy re-implementation of the documented per-tile quantization with ml_dtypes
casts (exactness up to f32 accumulation round-off).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fmtkit import fp8
from fmtkit.formats import get_format

DN = (((1,), (0,)), ((), ()))  # x [M, K] · w [K, N]


def data(m=256, k=512, n=256, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (m, k), jnp.float32)
    w = jax.random.normal(k2, (k, n), jnp.float32) / np.sqrt(k)
    dy = jax.random.normal(k3, (m, n), jnp.float32)
    return x, w, dy


def sqnr(ref, y):
    ref, y = np.asarray(ref, np.float64), np.asarray(y, np.float64)
    return 10 * np.log10(np.sum(ref**2) / np.sum((ref - y) ** 2))


def fwd_bwd(recipe, x, w, dy, state=None):
    dg = fp8.dot_general_fn(recipe)
    kw = {} if state is None else {"fp8_state": state}
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DN, **kw), x, w)
    gx, gw = vjp(dy)
    return y, gx, gw


_FMT = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def np_tile_qdq(t, tile, fmt):
    """float64 reference of one operand's quantization [F, C] (C the contraction) for the
    recipes' tilings, with edge blocks completed by zeros; returns the dequantized [F, C]."""
    dtype, fmax = _FMT[fmt]
    t = np.asarray(t, np.float32)
    f, c = t.shape
    if tile == "tensor":
        bf, bc = f, c
    elif tile == "row":
        bf, bc = 1, c
    elif tile == "mx32":
        bf, bc = 1, 32
    else:
        bf, bc = (int(v) for v in tile.split("x"))
    fp, cp = -(-f // bf) * bf, -(-c // bc) * bc
    padded = np.zeros((fp, cp), np.float32)
    padded[:f, :c] = t
    blocks = padded.reshape(fp // bf, bf, cp // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True).astype(np.float64)
    if tile == "mx32":  # "rceil": the smallest power of two 2^k with amax <= 448 * 2^k
        k = np.ceil(np.log2(np.where(amax == 0, 1.0, amax / fmax)))
        k = np.where(amax > fmax * 2.0**k, k + 1, k)
        k = np.where(amax <= fmax * 2.0 ** (k - 1), k - 1, k)
        scale = np.where(amax == 0, 1.0, 2.0**k).astype(np.float32)
    else:
        scale = (amax.astype(np.float32) * np.float32(1.0 / fmax)).astype(np.float32)
        scale = np.where(amax == 0, np.float32(1.0), np.maximum(scale, np.float32(2.0**-126)))
    inv = (np.float32(1.0) / scale).astype(np.float32)
    vals = np.clip((blocks * inv).astype(np.float32), -fmax, fmax).astype(dtype)
    deq = vals.astype(np.float64) * scale.astype(np.float64)
    return deq.reshape(fp, cp)[:f, :c]


def reference_gemms(recipe, x, w, dy):
    """float64 products of the recipe's quantized operands: y, dx, dw (w is [K, N])."""
    r = fp8.get_recipe(recipe)
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    y = np_tile_qdq(x, r.x_tile, r.x_format) @ np_tile_qdq(w.T, r.w_tile, r.w_format).T
    dx = np_tile_qdq(dy, r.grad_tile, r.grad_format) @ np_tile_qdq(w, r.w_tile, r.w_format).T
    dw = (np_tile_qdq(dy.T, r.grad_tile, r.grad_format)
          @ np_tile_qdq(x.T, r.x_tile, r.x_format).T).T
    return y, dx, dw


def exact_operand(key, shape, fmt, e, dtype):
    """Half the elements ±fmax·2^e, the others ±q·2^(E-mb-j) with q in [2^mb, 2^(mb+1)),
    j in {1, 2} (mb the format's mantissa bits, E = floor(log2 fmax) + e): every mantissa of
    the format occurs, so a wrong element format rounds some of them. Every tile's amax is
    fmax·2^e (or, in the unlikely tile without such an element, a power of two below that),
    so its scale amax·f32(1/fmax) is exactly a power of two (f32(448)·f32(1/448) == 1,
    likewise 57344), every scaled element is exact in the format, and every sum of at most
    256 products is a multiple of one power of two with fewer than 2^21 of them: exact in f32
    in any order. The fast path's f32 result then has one right answer, the float64 product
    of the reference."""
    f = get_format(fmt)
    mb, top = f.mantissa_bits, int(np.floor(np.log2(f.max))) + e
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.randint(k1, shape, 2**mb, 2 ** (mb + 1)).astype(jnp.float32)
    j = jax.random.randint(k2, shape, 1, 3).astype(jnp.float32)
    small = q * jnp.exp2(top - mb - j)
    big = jax.random.bernoulli(k3, 0.5, shape)
    sign = jnp.where(jax.random.bernoulli(k4, 0.5, shape), -1.0, 1.0)
    return (sign * jnp.where(big, f.max * 2.0**e, small)).astype(dtype)
