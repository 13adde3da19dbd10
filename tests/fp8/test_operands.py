"""Operands of any shape: every dimension that a tiling blocks is zero-padded inside the GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_testlib import data, fwd_bwd, reference_gemms
from jaxpr_utils import dot_operand_dtypes

from fmtkit import fp8

# Sizes no block divides: 100 tokens (the weight gradient's contraction), K = 200, N = 72
# (a 10-class head or a vocabulary of 72 behaves the same), and one aligned case.
_ODD_SHAPES = [(100, 200, 72), (256, 130, 300), (128, 256, 128)]


@pytest.mark.parametrize("shape", _ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", [n for n in fp8.RECIPES if n != "delayed"])
def test_any_shape_equals_float64_reference_of_same_quantization(name, shape):
    m, k, n = shape
    x, w, dy = data(m, k, n, seed=7)
    y, gx, gw = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g))(x, w, dy)
    assert (y.shape, gx.shape, gw.shape) == ((m, n), (m, k), (k, n))
    # Same quantized values; the only difference is f32 accumulation (at most ~300 terms of
    # magnitude <= |ref| max): 1e-5 of the largest output covers it with room.
    for got, ref in zip((y, gx, gw), reference_gemms(name, x, w, dy)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_delayed_any_shape_trains_a_step():
    x, w, dy = data(100, 200, 72, seed=8)
    state = fp8.init_state()
    y, gx, gw = jax.jit(lambda a, b, g: fwd_bwd("delayed", a, b, g, state))(x, w, dy)
    # first step bootstraps: equals current scaling, which the reference above checks
    y_ref, gx_ref, gw_ref = reference_gemms("current", x, w, dy)
    for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_padded_gemms_still_take_fp8_operands():
    x, w, dy = data(100, 200, 72)
    dots = dot_operand_dtypes(jax.make_jaxpr(
        lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy))
    assert len(dots) == 3
    assert all(jnp.dtype(d).itemsize == 1 for pair in dots for d in pair), dots
