"""The FP8 core's three GEMMs (forward, dgrad, wgrad) against float64 references: accuracy on
Gaussian data, and the float64 product of the same quantized operands.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_testlib import DN, data, exact_operand, fwd_bwd, reference_gemms, sqnr

from fmtkit import fp8

# Accuracy floors per recipe on Gaussian data (SQNR in dB against float64 on the unquantized
# inputs). E4M3 has 3 mantissa bits: RNE noise alone is ~ 6.02 * 4 + 10.8 ≈ 30 dB per operand,
# and a product of two quantized operands loses ~3 dB. E5M2 (gradients of the per-tensor and
# row-wise recipes) has one bit less: ~6 dB lower on the gradient GEMMs.
SQNR_FLOOR = {
    #            forward, gradients
    "current": (25.0, 20.0),
    "delayed": (25.0, 20.0),
    "rowwise": (25.0, 20.0),
    "blockwise": (25.0, 25.0),
    "mxfp8": (25.0, 25.0),
}


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_accuracy_against_float64(name):
    x, w, dy = data()
    state = fp8.init_state() if fp8.RECIPES[name].delayed else None
    y, gx, gw = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g, state))(x, w, dy)
    xr, wr, dyr = (np.asarray(a, np.float64) for a in (x, w, dy))
    fwd_floor, grad_floor = SQNR_FLOOR[name]
    assert sqnr(xr @ wr, y) >= fwd_floor
    assert sqnr(dyr @ wr.T, gx) >= grad_floor
    assert sqnr(xr.T @ dyr, gw) >= grad_floor


def _np_block_qdq(t, block, fmt_dtype, fmax):
    """float64 reference of the documented tile quantization (scale = amax * f32(1/max))."""
    t = np.asarray(t, np.float32)
    f, c = t.shape
    bf, bc = block
    blocks = t.reshape(f // bf, bf, c // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True)
    scale = (amax * np.float32(1.0 / fmax)).astype(np.float32)
    scale = np.where(amax == 0, np.float32(1.0), np.maximum(scale, np.float32(2.0**-126)))
    inv = (np.float32(1.0) / scale).astype(np.float32)
    vals = np.clip((blocks * inv).astype(np.float32), -fmax, fmax).astype(fmt_dtype)
    return (vals.astype(np.float64) * scale.astype(np.float64)).reshape(f, c)


def test_blockwise_equals_float64_reference_of_same_quantization():
    x, w, dy = data()
    y, gx, gw = jax.jit(lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy)
    e4m3, mx = ml_dtypes.float8_e4m3fn, 448.0
    # forward: x tiles 1x128 along K; w [N, K] blocks 128x128
    y_ref = _np_block_qdq(x, (1, 128), e4m3, mx) @ _np_block_qdq(w.T, (128, 128), e4m3, mx).T
    # dgrad: dy [M, N] tiles 1x128 along N; wᵀ as [K, N] blocks 128x128
    gx_ref = _np_block_qdq(dy, (1, 128), e4m3, mx) @ _np_block_qdq(w, (128, 128), e4m3, mx).T
    # wgrad: dyᵀ [N, M] and xᵀ [K, M], tiles 1x128 along the tokens M (128x1 of dy and x)
    gw_ref = (_np_block_qdq(dy.T, (1, 128), e4m3, mx)
              @ _np_block_qdq(x.T, (1, 128), e4m3, mx).T).T
    # Same quantized values; only f32 accumulation order differs (K = 512 terms).
    for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-5, atol=2e-5)


def test_per_tensor_equals_float64_reference_of_same_quantization():
    x, w, dy = data()
    y, gx, _ = jax.jit(lambda a, b, g: fwd_bwd("current", a, b, g))(x, w, dy)
    m, k = x.shape
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    xq = _np_block_qdq(x, (m, k), e4m3, 448.0)
    wq = _np_block_qdq(w.T, w.T.shape, e4m3, 448.0)
    dyq = _np_block_qdq(dy, dy.shape, e5m2, 57344.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), xq @ wq.T, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gx, np.float64), dyq @ wq, rtol=2e-5, atol=2e-5)


def test_outlier_channels_blockwise_vs_per_tensor():
    """Seeds' comparison inside a real GEMM: 4 channels of x scaled by 1e4.

    w's rows for the first K-block (which holds the outlier channels) are zeroed, so the
    output measures how well the *other* channels survive quantization.
    """
    x, w, _ = data(256, 512, 128)
    w = w.at[:128].set(0.0)

    def err(name, xx):
        y = np.asarray(fp8.dot_general_fn(name)(xx, w, DN), np.float64)
        ref = np.asarray(xx, np.float64) @ np.asarray(w, np.float64)
        return np.linalg.norm(y - ref) / np.linalg.norm(ref)

    for outlier, factor in ((1e4, 1.4), (3e4, 3.0)):
        x_out = x.at[:, :4].multiply(outlier)
        assert err("blockwise", x_out) < 1.1 * err("blockwise", x)  # format's own level
        # Per-tensor: normal channels fall into E4M3's subnormals (seeds: 4.9% at 1e4,
        # 14.1% at 3e4, against ~2.6% per operand for blocks).
        assert err("current", x_out) > factor * err("blockwise", x_out)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(128, 256, 128), (100, 200, 72)], ids=["aligned", "odd"])
@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_every_recipe_is_bit_identical_to_the_float64_reference(name, shape, dtype):
    """Forward, dgrad and wgrad of every recipe equal, bit for bit, the float64 product of the
    operands quantized by the NumPy + ml_dtypes reference (``reference_gemms``), on inputs
    where the f32 accumulation is exact (``exact_operand``). Guards every rewrite of the
    quantize / GEMM core for speed: a change of element format, rounding, clipping,
    padding or transposition moves outputs. (A wrong scale that the dequantization undoes
    is invisible on these inputs: the tolerance tests on Gaussian data cover scales.)"""
    r = fp8.get_recipe(name)
    m, k, n = shape
    keys = jax.random.split(jax.random.key(11), 3)
    x = exact_operand(keys[0], (m, k), r.x_format, -3, dtype)
    w = exact_operand(keys[1], (k, n), r.w_format, -9, dtype)
    dy = exact_operand(keys[2], (m, n), r.grad_format, -17, dtype)
    state = fp8.init_state(r) if r.delayed else None  # first step: bootstrapped = current
    y, gx, gw = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g, state))(x, w, dy)
    for what, got, ref in zip(("y", "dx", "dw"), (y, gx, gw), reference_gemms(name, x, w, dy)):
        assert got.dtype == dtype, what
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(dtype))  # one rounding
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name} {what}")
