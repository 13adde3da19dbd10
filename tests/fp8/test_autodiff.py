"""Forward-mode AD: the tangent runs through the forward GEMM's quantized operands (f32);
reverse mode keeps the recipe's backward GEMMs (the float64 reference tests of the core).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_testlib import DN, data, np_tile_qdq

from fmtkit import fp8


def _jvp_case(name, m=96, k=200, n=72, dtype=jnp.float32):
    r = fp8.get_recipe(name)
    x, w, _ = data(m, k, n, seed=5)
    dx, dw, _ = data(m, k, n, seed=6)
    kw = {"fp8_state": fp8.init_state(r)} if r.delayed else {}

    def f(a, b):
        return fp8.dot_general_fn(name)(a, b, DN, **kw)

    x, w, dx, dw = (a.astype(dtype) for a in (x, w, dx, dw))
    qx = np_tile_qdq(x, r.x_tile, r.x_format)  # [M, K], tiles along K
    qw = np_tile_qdq(np.asarray(w, np.float32).T, r.w_tile, r.w_format)  # [N, K]
    return f, (x, w, dx, dw), qx, qw


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_forward_mode_tangent_is_the_product_through_the_quantized_operands(name):
    """``jax.jvp`` of the FP8 dot: ``ẏ = ẋ · Q(w) + Q(x) · ẇ`` with ``Q`` the forward GEMM's
    quantization (float64 reference ``np_tile_qdq``), computed in f32: within the f32
    summation bound. The unquantized product (ẋ · w + x · ẇ) differs by ~2% (E4M3), far
    outside it; the primal is the FP8 forward, bit for bit."""
    f, (x, w, dx, dw), qx, qw = _jvp_case(name)
    y, t = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, dx, dw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(f)(x, w)))
    dx64, dw64 = np.asarray(dx, np.float64), np.asarray(dw, np.float64)
    want = dx64 @ qw.T + qx @ dw64
    bound = 2 * 200 * 2.0**-24 * (np.abs(dx64) @ np.abs(qw).T + np.abs(qx) @ np.abs(dw64))
    assert t.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(t, np.float64) - want) <= bound + 1e-30)
    unquantized = dx64 @ np.asarray(w, np.float64) + np.asarray(x, np.float64) @ dw64
    assert np.max(np.abs(unquantized - want) - bound) > 0  # the check tells them apart


def test_forward_mode_tangent_of_bf16_operands_is_bf16_rounded_once():
    f, (x, w, dx, dw), qx, qw = _jvp_case("current", dtype=jnp.bfloat16)
    y, t = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, dx, dw)
    assert y.dtype == t.dtype == jnp.bfloat16
    dx64, dw64 = np.asarray(dx, np.float64), np.asarray(dw, np.float64)
    want = dx64 @ qw.T + qx @ dw64
    err = np.abs(np.asarray(t, np.float64) - want)
    assert np.all(err <= 2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max())


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_jacfwd_is_the_quantized_weight_exactly(name):
    """``jax.jacfwd`` (the tangent under ``vmap``) of y = x · w with respect to x:
    ∂y[i, j] / ∂x[a, b] = δ(i, a) Q(w)[b, j], Q(w) dequantized in f32 (one rounding of
    the exact float64 product of value and scale), exact after that (one nonzero product per
    output); batched dots too (one GEMM per batch element)."""
    f, (x, w, _, _), _, qw = _jvp_case(name, m=6, k=40, n=24)
    jac = jax.jacfwd(lambda a: f(a, w))(x)
    want = np.einsum("ia,jb->ijab", np.eye(6), qw.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(np.asarray(jac, np.float64), want)
    xb = jnp.stack([x, 2 * x])
    wb = jnp.stack([w, w])
    dims = (((2,), (1,)), ((0,), (0,)))
    jac_b = jax.jacfwd(lambda a: fp8.dot_general(a, wb, dims, recipe=name))(xb)
    np.testing.assert_array_equal(np.asarray(jac_b[1, :, :, 1], np.float64), want)
    assert not np.any(np.asarray(jac_b[0, :, :, 1]))


@pytest.mark.parametrize("name", ["current", "delayed", "blockwise", "nvfp4"])
def test_hessian_vector_product_through_the_quantized_operands(name):
    """``jax.jvp`` of ``jax.grad`` (forward over reverse) of L(x, w) = Σ sin(x · w) in the
    direction (u, v). The gradient's GEMMs dx = g · wᵀ, dw = xᵀ · g (g = cos y) take their
    tangents through the forward GEMM's quantized operands, in f32:
    ḋx = ġ · Q(w)ᵀ + g · vᵀ, ḋw = Q(x)ᵀ · ġ + uᵀ · g, ġ = -sin(y) ⊙ (u · Q(w) + Q(x) · v),
    y = Q(x) · Q(w) (float64 reference). Dropping the g · vᵀ term (the residuals' tangent)
    moves ḋx by O(1)."""
    r = fp8.get_recipe(name)
    m, k, n = 48, 64, 32
    x, w, _ = data(m, k, n, seed=7)
    u, v, _ = data(m, k, n, seed=8)
    kw = {"fp8_state": fp8.init_state(r)} if getattr(r, "delayed", False) else {}

    def loss(a, b):
        return jnp.sum(jnp.sin(fp8.dot_general(a, b, DN, recipe=name, **kw)))

    (hx, hw) = jax.jit(lambda *a: jax.jvp(jax.grad(loss, argnums=(0, 1)), a[:2], a[2:])[1])(
        x, w, u, v)
    if name == "nvfp4":
        from fmtkit import fp4
        # The forward GEMM's operands: x [M, K] in 1x16 blocks and wᵀ [N, K] in 16x16 blocks,
        # round to nearest (NVFP4's forward; the quantizer is checked against ml_dtypes in
        # tests/fp4/test_nvfp4_mxfp4.py), dequantized.
        qx = np.asarray(fp4.nvfp4_quantize(x, (1, 16)).dequantize(), np.float64)
        qw = np.asarray(fp4.nvfp4_quantize(w.T, (16, 16)).dequantize(), np.float64)
    else:
        qx = np_tile_qdq(x, r.x_tile, r.x_format)
        qw = np_tile_qdq(np.asarray(w).T, r.w_tile, r.w_format)
    u64, v64 = (np.asarray(a, np.float64) for a in (u, v))
    y = qx @ qw.T
    g, g_dot = np.cos(y), -np.sin(y) * (u64 @ qw.T + qx @ v64)
    want_x = g_dot @ qw + g @ v64.T
    want_w = qx.T @ g_dot + u64.T @ g
    for got, want in ((hx, want_x), (hw, want_w)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
    dropped = g_dot @ qw
    assert np.linalg.norm(dropped - want_x) > 0.1 * np.linalg.norm(want_x)


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_second_derivatives_through_the_tangent(name):
    """Forward over forward (``jacfwd`` of ``jacfwd``) of L(x) = Σ sin(x · w): the Hessian
    through the quantized weight, H[i, b, i, d] = -Σ_j sin(y[i, j]) Q(w)[b, j] Q(w)[d, j]
    (float64 reference, y = Q(x) · Q(w)); the same as ``jax.hessian`` (forward over
    reverse). Reverse over forward (``grad`` of a ``jvp``): the tangent ẋ · Q(w) + Q(x) · ẇ
    differentiated in w with the quantization's derivative the identity:
    ∂/∂w Σ ((u · Q(w)) ⊙ c) = uᵀ · c."""
    f, (x, w, u, _), _, _ = _jvp_case(name, m=3, k=40, n=24)
    r = fp8.get_recipe(name)

    def loss(a):
        return jnp.sum(jnp.sin(f(a, w)))

    h = jax.jit(jax.jacfwd(jax.jacfwd(loss)))(x)
    qx = np_tile_qdq(x, r.x_tile, r.x_format)
    qw = np_tile_qdq(np.asarray(w, np.float32).T, r.w_tile, r.w_format)  # [N, K]
    s = -np.sin(qx @ qw.T)  # [M, N]
    inner = np.einsum("ij,jb,jd->ibd", s, qw, qw)
    want = np.einsum("ibd,ia->ibad", inner, np.eye(3))  # ∂²L / ∂x[i, b] ∂x[a, d]
    got = np.asarray(h, np.float64)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    hr = np.asarray(jax.jit(jax.hessian(loss))(x), np.float64)
    assert np.linalg.norm(hr - want) <= 1e-5 * np.linalg.norm(want)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((3, 24)), jnp.float32)
    gw = jax.jit(jax.grad(lambda b: jnp.sum(jax.jvp(f, (x, b), (u, jnp.zeros_like(b)))[1]
                                            * c)))(w)
    want_w = np.asarray(u, np.float64).T @ np.asarray(c, np.float64)
    bound = 2 * 3 * 2.0**-24 * (np.abs(np.asarray(u, np.float64)).T @ np.abs(np.asarray(c)))
    assert np.all(np.abs(np.asarray(gw, np.float64) - want_w) <= bound)
