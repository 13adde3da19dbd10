"""Adam / AdamW with moments stored in bf16, fp16 or FP8 (scaled), computed in f32."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from tolerances import rtol  # tests/ is on sys.path (pytest rootdir)

from fmtkit import BlockScaling, MXScaling, ScaledArray, TensorScaling, dequantize, optim

from ._reference import adam_reference, quantize_reference

E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448 (OCP FP8 v1.0)
F16_MAX = float(ml_dtypes.finfo(np.float16).max)


def _grads(n_steps, shape, seed=0):
    rng = np.random.default_rng(seed)
    # Per-column magnitudes spanning 1e-4..1e2, so that per-block scales matter.
    cols = np.logspace(-4, 2, shape[-1]).astype(np.float32)
    return [(rng.standard_normal(shape).astype(np.float32) * cols) for _ in range(n_steps)]


@functools.lru_cache
def _runner(opt):
    def run(params, grads):
        def body(s, g):
            u, s = opt.update(g, s, params)
            return s, (u, s.mu, s.nu)
        return jax.lax.scan(body, opt.init(params), grads)[1]
    return jax.jit(run)


def _as_f32(x):
    return dequantize(x, jnp.float32) if isinstance(x, ScaledArray) else x.astype(jnp.float32)


def test_f32_storage_is_optax_adam_bit_for_bit():
    params = {"w": jnp.zeros((8, 16)), "b": jnp.zeros(16)}
    grads = [{"w": jnp.asarray(g), "b": jnp.asarray(g[0])} for g in _grads(6, (8, 16))]
    for ours, theirs in [(optim.adam(1e-2), optax.adam(1e-2)),
                         (optim.adamw(1e-2, weight_decay=0.3), optax.adamw(1e-2,
                                                                            weight_decay=0.3))]:
        s1, s2 = ours.init(params), None
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam is not strict-clean
            s2 = theirs.init(params)
            p = params
            for g in grads:
                u1, s1 = jax.jit(ours.update)(g, s1, p)
                u2, s2 = jax.jit(theirs.update)(g, s2, p)
                for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                p = optax.apply_updates(p, u1)


@pytest.mark.parametrize("mu_dtype,nu_dtype", [("bf16", "bf16"), ("fp16", "bf16"),
                                               ("bf16", "f32")])
def test_16_bit_moments_match_a_rounding_reference(mu_dtype, nu_dtype):
    np_types = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "f32": np.float32}
    shape = (4, 64)
    grads = _grads(12, shape)
    opt = optim.scale_by_adam(mu_dtype=mu_dtype, nu_dtype=nu_dtype)
    us, mus, nus = _runner(opt)(jnp.zeros(shape), jnp.asarray(np.stack(grads)))
    assert mus.dtype == np.dtype(np_types[mu_dtype]) and nus.dtype == np.dtype(np_types[nu_dtype])
    ref = adam_reference(grads, store_mu=lambda x: x.astype(np_types[mu_dtype]),
                         store_nu=lambda x: x.astype(np_types[nu_dtype]))
    tol = max(rtol(np_types[mu_dtype]), rtol(np_types[nu_dtype]))
    for t, (u, m, v) in enumerate(ref):
        # f32 arithmetic in both; a rare f32 ulp difference can flip one rounding.
        np.testing.assert_allclose(np.asarray(us[t]), u, rtol=tol, atol=0)
        np.testing.assert_allclose(np.asarray(mus[t], np.float32), m, rtol=tol)
        np.testing.assert_allclose(np.asarray(nus[t], np.float32), v, rtol=tol)
        assert np.mean(np.asarray(mus[t], np.float32) == m) > 0.99


@pytest.mark.parametrize("recipe,block", [(TensorScaling(), None),
                                          (BlockScaling((1, 32)), (1, 32))])
def test_fp8_moments_with_scales(recipe, block):
    shape = (4, 64)
    grads = _grads(10, shape, seed=1)
    opt = optim.scale_by_adam(mu_dtype="e4m3", nu_dtype="e4m3", mu_scaling=recipe,
                              nu_scaling=recipe)
    state = opt.init(jnp.zeros(shape))
    assert isinstance(state.mu, ScaledArray) and state.mu.values.dtype == jnp.float8_e4m3fn
    expect_scale = (1, 1) if block is None else (4, 2)
    assert state.mu.scale.shape == expect_scale and state.mu.scale.dtype == jnp.float32
    us, mus, nus = _runner(opt)(jnp.zeros(shape), jnp.asarray(np.stack(grads)))
    q = functools.partial(quantize_reference, dtype=ml_dtypes.float8_e4m3fn, fmt_max=E4M3_MAX,
                          block=block)
    ref = adam_reference(grads, store_mu=q, store_nu=q)
    for t, (u, m, v) in enumerate(ref):
        mu_t = np.asarray(_as_f32(jax.tree.map(lambda x, t=t: x[t], mus)))
        nu_t = np.asarray(_as_f32(jax.tree.map(lambda x, t=t: x[t], nus)))
        # XLA computes x / scale as x * (1 / scale) (an f32 ulp off true division), so the
        # stored values match to ~2 f32 ulps, except where that flips an E4M3 rounding.
        for got, want in [(mu_t, m), (nu_t, v)]:
            assert np.mean(np.isclose(got, want, rtol=2.0**-21, atol=0)) > 0.98
            np.testing.assert_allclose(got, want, rtol=rtol(ml_dtypes.float8_e4m3fn),
                                       atol=float(np.max(np.abs(want))) * 2.0**-9 / E4M3_MAX)
        np.testing.assert_allclose(np.asarray(us[t]), u, rtol=rtol(ml_dtypes.float8_e4m3fn))


def test_block_scales_keep_small_columns_that_a_tensor_scale_flushes():
    """nu spans g^2 ~ 1e-8..1e4: one E4M3 scale flushes the small columns to zero, 1x8
    blocks keep them (the reason for per-block scales)."""
    shape = (4, 64)
    grads = _grads(1, shape)
    outs = {}
    for name, recipe in [("tensor", TensorScaling()), ("block", BlockScaling((1, 8)))]:
        opt = optim.scale_by_adam(nu_dtype="e4m3", nu_scaling=recipe)
        _, s = jax.jit(opt.update)(jnp.asarray(grads[0]), opt.init(jnp.zeros(shape)))
        outs[name] = np.asarray(_as_f32(s.nu))
    exact = (1 - 0.999) * grads[0] ** 2
    small = exact[:, :32] > 0
    assert np.mean(outs["tensor"][:, :32][small] == 0) > 0.5
    assert np.mean(outs["block"][:, :32][small] == 0) < 0.05


def test_ms_amp_recipe_trains_like_f32_moments():
    """MS-AMP O2 (FP8-LM, section 3.2): m in E4M3, v in FP16, per-tensor scales."""
    target = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)

    def loss(p):
        return jnp.mean((p["w"] - target) ** 2)

    def train(opt):
        def body(carry, _):
            p, s = carry
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss(p)
        p = {"w": jnp.zeros((16, 32))}
        return jax.jit(lambda: jax.lax.scan(body, (p, opt.init(p)), None, length=300)[1])()

    ref = train(optim.adamw(3e-2))
    msamp = train(optim.adamw(3e-2, mu_dtype="e4m3", nu_dtype="fp16",
                              nu_scaling=TensorScaling()))
    assert float(ref[-1]) < 1e-2 * float(ref[0])
    assert float(msamp[-1]) < 1e-2 * float(msamp[0])
    assert abs(float(msamp[-1]) - float(ref[-1])) < 0.5 * float(ref[-1]) + 1e-4


def test_bf16_nu_stops_decaying_with_nearest_rounding():
    """0.999 v is within half a bf16 ulp of v (1e-3 < 2^-9), so nearest rounding keeps v;
    stochastic rounding keeps the decay in expectation."""
    n = 4096
    ones = jnp.ones((30, n), jnp.float32)
    zeros = jnp.zeros((200, n), jnp.float32)
    grads = jnp.concatenate([ones, zeros])
    runs = {}
    for rounding in ("nearest", "stochastic"):
        opt = optim.scale_by_adam(nu_dtype="bf16", rounding=rounding, seed=1)
        _, _, nus = _runner(opt)(jnp.zeros(n), grads)
        runs[rounding] = np.asarray(nus, np.float32)
    near, sr = runs["nearest"], runs["stochastic"]
    np.testing.assert_array_equal(near[-1], near[29])  # stuck for 200 steps
    expected = np.float64(np.mean(sr[29])) * 0.999**200  # f64 decay of the mean
    assert abs(np.mean(sr[-1]) / expected - 1) < 0.01
    assert np.mean(near[-1]) / expected > 1.2  # 0.999^-200 = 1.22: no decay at all


def test_stochastic_moments_are_deterministic_given_the_seed():
    g = jnp.asarray(np.stack(_grads(3, (2, 32))))
    opt = optim.scale_by_adam(mu_dtype="bf16", nu_dtype="e5m2", nu_scaling=TensorScaling(),
                              rounding="stochastic", seed=7)

    @jax.jit
    def run(state):  # the seed is an int32 in the state: one compile for every seed
        def body(s, gi):
            _, s = opt.update(gi, s)
            return s, (s.mu, s.nu)
        return jax.lax.scan(body, state, g)[1]

    state = opt.init(jnp.zeros((2, 32)))
    assert int(state.seed) == 7
    a, b, c = (run(state), run(state), run(state._replace(seed=jnp.asarray(8, jnp.int32))))
    leaves = [[np.asarray(x) for x in jax.tree.leaves(r)] for r in (a, b, c)]
    assert all(np.array_equal(x, y) for x, y in zip(leaves[0], leaves[1]))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves[0], leaves[2]))


def test_block_that_does_not_divide_names_the_parameter():
    opt = optim.scale_by_adam(mu_dtype="e4m3", mu_scaling=BlockScaling((1, 128)))
    with pytest.raises(ValueError, match=r"\['bias'\]"):
        opt.init({"kernel": jnp.zeros((2, 128)), "bias": jnp.zeros(100)})


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(b1=1.0), ValueError, "b1"),
    (dict(b2=-0.1), ValueError, "b2"),
    (dict(rounding="up"), ValueError, "rounding"),
    (dict(mu_dtype="e4m3", mu_scaling=MXScaling()), TypeError, "mu_scaling"),
    (dict(nu_scaling=TensorScaling()), ValueError, "nu_dtype"),
    (dict(nu_dtype="e8m0"), ValueError, "nu_dtype"),
    (dict(mu_dtype="float7"), ValueError, "float7"),
])
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        optim.scale_by_adam(**kwargs)


def test_fp16_nu_with_scaling_does_not_overflow():
    """g^2 beyond f16's max (g > 256) overflows an unscaled f16 nu; a tensor scale holds it."""
    g = jnp.full((4,), 1000.0, jnp.float32)
    plain = optim.scale_by_adam(nu_dtype="fp16", nu_scaling="none", b2=0.0)
    scaled = optim.scale_by_adam(nu_dtype="fp16", nu_scaling=TensorScaling(), b2=0.0)
    _, s1 = plain.update(g, plain.init(jnp.zeros(4)))
    _, s2 = scaled.update(g, scaled.init(jnp.zeros(4)))
    assert np.all(np.isinf(np.asarray(s1.nu))) and 1e6 > F16_MAX
    np.testing.assert_allclose(np.asarray(_as_f32(s2.nu)), 1e6, rtol=rtol(np.float16))


# ---------------------------------------------------------------------------------------------
# 3000 steps on small steady gradients against optax.adam in f32 (the module docstring's
# numbers). Steady per-element gradients 1e-4 * [0.5, 1.5] are the worst case for a stalling
# nu (noise keeps kicking it); one scan per configuration, one module-scoped run.

_STEPS = 3000
_B2 = 0.999


def _steady_grad():
    return 1e-4 * jnp.linspace(0.5, 1.5, 256, dtype=jnp.float32)


@pytest.fixture(scope="module")
def long_runs():
    g = _steady_grad()
    configs = {
        "optax": optax.scale_by_adam(),
        "fp16": optim.scale_by_adam(mu_dtype="fp16", nu_dtype="fp16"),
        "fp16_unscaled": optim.scale_by_adam(nu_dtype="fp16", nu_scaling="none"),
        "bf16": optim.scale_by_adam(mu_dtype="bf16", nu_dtype="bf16"),
        "bf16_stochastic": optim.scale_by_adam(mu_dtype="bf16", nu_dtype="bf16",
                                               rounding="stochastic"),
    }

    def run(opt):
        p = jnp.zeros_like(g)

        def body(s, _):
            u, s = opt.update(g, s, p)
            return s, u
        return jax.lax.scan(body, opt.init(p), None, length=_STEPS)[1]

    out = {}
    for k, v in configs.items():
        # optax's bias correction (python float ** int32 count) is not strict-promotion clean
        with jax.numpy_dtype_promotion("standard" if k == "optax" else "strict"):
            out[k] = np.asarray(jax.jit(functools.partial(run, v))(), np.float64)
    return {k: v / out["optax"] for k, v in out.items() if k != "optax"}  # per-step ratios


def _bc2(t):
    return 1.0 - _B2**t


def test_fp16_moments_are_scaled_by_default_and_track_optax(long_runs):
    state = optim.scale_by_adam(nu_dtype="fp16").init(jnp.zeros(4))
    assert isinstance(state.nu, ScaledArray) and state.nu.recipe == TensorScaling()
    # moments in the parameters' dtype: the same rule per parameter (fp16 nu scaled; bf16 has
    # f32's range and stays plain, as does mu, which holds gradients, not their squares)
    state = optim.scale_by_adam().init({"h": jnp.zeros(4, jnp.float16),
                                        "b": jnp.zeros(4, jnp.bfloat16)})
    assert isinstance(state.nu["h"], ScaledArray) and state.nu["h"].values.dtype == jnp.float16
    assert state.nu["b"].dtype == jnp.bfloat16 and state.mu["h"].dtype == jnp.float16
    assert optim.scale_by_adam(nu_dtype="fp16", nu_scaling="none").init(
        jnp.zeros(4)).nu.dtype == jnp.float16
    # Scaled nu: no underflow. What is left is fp16 mu's own nearest-rounding stall (m stops
    # within 2^-10 / (1 - b1) ≈ 1% of g, on the m32 = 0.9 m + 0.1 g the update reads): every
    # update within 1% of optax's over 3000 steps, 0.3% on average (measured 0.9968).
    np.testing.assert_allclose(long_runs["fp16"], 1.0, atol=1e-2)
    assert abs(np.mean(long_runs["fp16"][-1]) - 1) < 5e-3


def test_unscaled_fp16_nu_underflows_as_documented(long_runs):
    """(1 - b2) g^2 = 1e-11 rounds to 0 in fp16 (smallest subnormal 2^-24 = 6e-8): nu stays 0
    and each update uses only this step's (1 - b2) g^2, so the ratio to optax (whose bias-
    corrected v is g^2 on a steady gradient) is (|g| + eps) / (|g| sqrt((1 - b2) / bc2) + eps)."""
    g = np.asarray(_steady_grad(), np.float64)
    for t in (10, 100, 3000):
        expected = (g + 1e-8) / (g * np.sqrt((1 - _B2) / _bc2(t)) + 1e-8)
        np.testing.assert_allclose(long_runs["fp16_unscaled"][t - 1], expected, rtol=1e-3)
    assert np.mean(long_runs["fp16_unscaled"][-1]) > 30  # the documented 31x at step 3000


def test_bf16_nu_stalls_with_nearest_rounding_as_documented(long_runs):
    """nu stops growing once (1 - b2)(g^2 - v) is below half a bf16 ulp of v, i.e. at
    v in [g^2 / (1 + 2^-8 / (1 - b2)), g^2 / (1 + 2^-9 / (1 - b2))]; f32 Adam's v reaches
    bc2 g^2, so the update ratio lies in sqrt(bc2 (1 + 2^-{9,8} / (1 - b2))); the bf16 mu
    stalls the same way below g, by up to 0.9 * 2^-8 / (1 - b1) = 3.5% (the lower bound)."""
    mu_stall = 1 - 0.9 * 2.0**-8 / (1 - 0.9)
    for t, documented in ((1000, 1.5), (3000, 1.85)):
        lo = mu_stall * np.sqrt(_bc2(t) * (1 + 2.0**-9 / (1 - _B2)))
        hi = np.sqrt(_bc2(t) * (1 + 2.0**-8 / (1 - _B2)))
        r = long_runs["bf16"][t - 1]
        assert np.all((r > 0.99 * lo) & (r < 1.01 * hi)), (t, r.min(), r.max(), lo, hi)
        assert abs(np.mean(r) - documented) < 0.05, (t, np.mean(r))
    # the remedy: stochastic rounding tracks optax in expectation
    assert abs(np.mean(long_runs["bf16_stochastic"][-1]) - 1) < 5e-3
    assert abs(np.mean(long_runs["bf16_stochastic"][999]) - 1) < 5e-3
