"""The grouped kernels as ``fmtkit.fp8.ragged_dot``'s GEMM backend (its ``ragged`` and
``ragged_wgrad`` forms): which GEMMs reach them, their numbers against the emulated path,
and an MoE layer trained under a policy with the backend in interpret mode.

Interpret-mode runs take 30-90 s on a 2-core CPU (slow)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallas_kernels  # noqa: F401  (registers the backend)
from fmtkit import fp8
from fmtkit._lowp import backends
from fmtkit.policy import Policy, with_policy

INTERPRET = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
XLA = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="never")
# Kernel vs the emulated path on the same FP8 operands (f32): the exact products of each
# 128-wide block summed in f32 in another order, a few f32 ulps of the block sums.
F32_RTOL = 1e-5


@contextlib.contextmanager
def _spy():
    """Records which form of the Pallas backend each grouped GEMM called."""
    name = "pallas_blockwise_fp8"
    saved = backends._GEMM_BACKENDS[name]
    calls = []

    def wrap(form):
        fn = getattr(saved, form)

        def spy(*args, impl, out_dtype):
            calls.append((form, impl, jnp.dtype(out_dtype).name))
            return fn(*args, impl=impl, out_dtype=out_dtype)
        return spy

    backends._GEMM_BACKENDS[name] = saved._replace(ragged=wrap("ragged"),
                                                    ragged_wgrad=wrap("ragged_wgrad"))
    try:
        yield calls
    finally:
        backends._GEMM_BACKENDS[name] = saved


def _fwd_bwd(recipe, x, w, gs, dy):
    y, vjp = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, gs, recipe,
                                                 preferred_element_type=jnp.float32), x, w)
    return (y, *vjp(dy))


@pytest.mark.slow
def test_ragged_dot_runs_the_three_grouped_gemms_on_the_kernel():
    """Forward and dgrad through ``ragged``, wgrad through ``ragged_wgrad``; equal to the
    emulated path up to f32 summation order. Group sizes on 128-token blocks (plus an
    empty expert): there the emulated path's token blocks are the padded layout's."""
    rng = np.random.default_rng(0)
    m, k, n = 256, 256, 128
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, k, n)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    gs = jnp.array([128, 0, 128], jnp.int32)
    with _spy() as calls:
        got = jax.jit(_fwd_bwd, static_argnums=0)(INTERPRET, x, w, gs, dy)
    assert sorted(c[0] for c in calls) == ["ragged", "ragged", "ragged_wgrad"]
    assert {c[1] for c in calls} == {"interpret"}
    want = jax.jit(_fwd_bwd, static_argnums=0)(XLA, x, w, gs, dy)
    for g_, w_ in zip(got, want):
        scale = float(jnp.abs(w_).max())
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=F32_RTOL,
                                   atol=F32_RTOL * scale)


# An MoE feed-forward block, tokens sorted by expert: 96 tokens in 4 experts, one empty,
# boundaries inside 64- and 128-row tiles, 6 tokens past nothing (sum = 96).
E, D, F, T = 4, 128, 256, 96
SIZES = jnp.array([40, 0, 50, 6], jnp.int32)


def moe_layer(params, x):
    h = jax.nn.gelu(jax.lax.ragged_dot(x, params["up"], SIZES))
    return x + jax.lax.ragged_dot(h, params["down"], SIZES)


def _train(recipe, steps=3):
    rng = np.random.default_rng(1)
    params = {"up": jnp.asarray(rng.standard_normal((E, D, F)) / 11, jnp.float32),
              "down": jnp.asarray(rng.standard_normal((E, F, D)) / 16, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    model = with_policy(moe_layer, Policy("float32", "bfloat16", fp8=recipe))
    opt = optax.sgd(0.1)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(
            lambda p_: jnp.mean(jnp.square(model(p_, x).astype(jnp.float32) - target)))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.slow
def test_moe_trained_with_the_kernel_matches_the_emulated_path():
    """Three SGD steps of an MoE block under a bf16 policy with the blockwise recipe: the
    grouped kernel (interpret mode) against the emulated path. The forward and data
    gradient GEMMs agree to f32 summation order before the bf16 rounding; the weight
    gradient quantizes each expert's tokens in its own 128-token blocks (the padded
    layout) where the emulated path's blocks span experts, an E4M3 rounding difference
    (2^-4 relative per element) on part of the gradient. The losses agree to 2^-8
    relative (bf16's rounding); the first step's loss (no update yet) to 2^-12."""
    with _spy() as calls:
        kernel = _train(INTERPRET)
    assert {c[0] for c in calls} == {"ragged", "ragged_wgrad"}
    emulated = _train(XLA)
    assert abs(kernel[0] - emulated[0]) <= 2.0**-12 * emulated[0]
    np.testing.assert_allclose(kernel, emulated, rtol=2.0**-8)
    assert kernel[-1] < kernel[0]  # it trains
