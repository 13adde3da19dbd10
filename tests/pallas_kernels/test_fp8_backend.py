"""The kernel as ``fmtkit.fp8``'s GEMM backend: the output dtype each training GEMM asks
for, and the training path's numerics (interpret-mode kernel vs the XLA fallback)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from fmtkit import fp8
from fmtkit._lowp import backends

DN = (((1,), (0,)), ((), ()))
BLOCKWISE_INTERPRET = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
BLOCKWISE_XLA = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="never")


@contextlib.contextmanager
def _spy():
    """Records the ``out_dtype`` of every call of the registered Pallas backend."""
    name = "pallas_blockwise_fp8"
    saved = backends._GEMM_BACKENDS[name]
    calls = []

    def fn(*args, impl, out_dtype):
        calls.append(jnp.dtype(out_dtype).name)
        return saved.fn(*args, impl=impl, out_dtype=out_dtype)

    backends._GEMM_BACKENDS[name] = saved._replace(fn=fn)
    try:
        yield calls
    finally:
        backends._GEMM_BACKENDS[name] = saved


def _fwd_bwd(recipe, x, w, dy):
    dg = fp8.dot_general_fn(recipe)
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DN), x, w)
    return (y, *vjp(dy))


def _data(dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (128, 256), jnp.float32).astype(dtype)
    w = (jax.random.normal(k2, (256, 128), jnp.float32) / 16).astype(dtype)
    dy = jax.random.normal(k3, (128, 128), jnp.float32).astype(dtype)
    return x, w, dy


def _kernel_run(dtype):
    """Forward and both gradients of a dot through the interpret-mode kernel, with the
    output dtypes the three GEMMs asked the kernel for."""
    x, w, dy = _data(dtype)
    with _spy() as calls:
        out = jax.jit(lambda a, b, g: _fwd_bwd(BLOCKWISE_INTERPRET, a, b, g))(x, w, dy)
    return out, calls


@pytest.fixture(scope="module")
def bf16_run():
    return _kernel_run(jnp.bfloat16)


def test_kernel_writes_what_the_consumer_reads(bf16_run):
    """A bf16 model's forward and data gradient get bf16 straight from the kernel; the
    weight gradient stays f32 (it is accumulated into f32 master weights). An f32 model
    gets f32 everywhere."""
    (y, dx, dw), calls = bf16_run
    assert calls == ["bfloat16", "bfloat16", "float32"]  # forward, dgrad, wgrad
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    (y, dx, dw), calls = _kernel_run(jnp.float32)
    assert calls == ["float32"] * 3
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32


def _bf16_ulps(a, b):
    """Distance in bf16 units in the last place (same-sign finite values)."""
    ia = np.asarray(a).view(np.uint16).astype(np.int64)
    ib = np.asarray(b).view(np.uint16).astype(np.int64)
    sa, sb = ia >> 15, ib >> 15
    mag = lambda i: i & 0x7FFF  # noqa: E731
    return np.where(sa == sb, np.abs(mag(ia) - mag(ib)), mag(ia) + mag(ib))


def test_bf16_training_path_matches_the_xla_fallback(bf16_run):
    """The interpret-mode kernel against the XLA fallback (``use_kernel="never"``) for a
    bf16 model. Both accumulate exact FP8 products in f32 block by block; only the order
    inside a 128-wide K block differs (a few f32 ulps), so the single rounding to bf16
    agrees bit for bit except where an f32 value sits at a rounding tie: at most one bf16
    ulp, on a small fraction of elements. The f32 weight gradient: f32 round-off."""
    x, w, dy = _data(jnp.bfloat16)
    got, _ = bf16_run
    ref = jax.jit(lambda a, b, g: _fwd_bwd(BLOCKWISE_XLA, a, b, g))(x, w, dy)
    for g_, r_ in zip(got[:2], ref[:2]):  # y, dx: bf16 from the kernel
        ulps = _bf16_ulps(g_, r_)
        assert ulps.max() <= 1 and (ulps > 0).mean() < 0.01
    gw, rw = (np.asarray(t, np.float64) for t in (got[2], ref[2]))
    # dw is bf16 here (w's dtype), rounded from the f32 kernel output: same bound
    assert _bf16_ulps(got[2], ref[2]).max() <= 1
    assert np.linalg.norm(gw - rw) / np.linalg.norm(rw) < 2.0**-8


def test_bf16_output_is_the_rounded_f32_output():
    """The kernel's own bf16 epilogue equals its f32 output rounded by XLA, bit for bit:
    moving the conversion into the kernel changes no number."""
    from pallas_kernels.quantize import quantize_1x128_reference, quantize_128x128_reference

    k1, k2 = jax.random.split(jax.random.key(1))
    xq, xs = quantize_1x128_reference(jax.random.normal(k1, (256, 512)))
    wq, ws = quantize_128x128_reference(jax.random.normal(k2, (320, 512)))
    out16 = pallas_kernels.blockwise_fp8_matmul(xq, xs, wq, ws, out_dtype=jnp.bfloat16,
                                                impl="interpret")
    out32 = pallas_kernels.blockwise_fp8_matmul(xq, xs, wq, ws, out_dtype=jnp.float32,
                                                impl="interpret")
    np.testing.assert_array_equal(np.asarray(out16).view(np.uint16),
                                  np.asarray(out32.astype(jnp.bfloat16)).view(np.uint16))
