"""Master weights (exactly round(master) through plain optax.apply_updates, linen and NNX),
and the no-master options: stochastic rounding and Kahan-compensated updates.

The suite runs under strict dtype promotion, where optax.apply_updates refuses bf16 + f32;
calls to it sit inside ``jax.numpy_dtype_promotion("standard")``, JAX's default, which is
what users run."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fmtkit import optim

N_STEPS = 1000
STEP = 1e-3


@functools.lru_cache
def _scan(opt, n, apply):
    def run(params, grads):
        def body(carry, _):
            p, s = carry
            u, s = opt.update(grads, s, p)
            return (apply(p, u, s), s), None

        return jax.lax.scan(body, (params, opt.init(params)), None, length=n)[0]
    return jax.jit(run)


def _run(opt, params, grads, n, apply):
    """n jitted steps (lax.scan) with constant grads; returns the final params and state."""
    with jax.numpy_dtype_promotion("standard"):  # optax.apply_updates: bf16 + f32 deltas
        return _scan(opt, n, apply)(params, grads)


def _optax(p, u, s):
    return optax.apply_updates(p, u)


def _apply(params, updates):
    """optax.apply_updates as users call it (standard promotion)."""
    with jax.numpy_dtype_promotion("standard"):
        return optax.apply_updates(params, updates)


def _numpy_accumulate(dtype, start=1.0, step=STEP, n=N_STEPS):
    """Reference: x = round(x + round(step)) n times, in ``dtype`` (NumPy / ml_dtypes)."""
    x, d = dtype(start), dtype(step)
    for _ in range(n):
        x = dtype(np.float32(x) + np.float32(d))  # one exact f32 add, one rounding
    return float(x)


def test_plus_1e3_a_thousand_times():
    """The seeds' experiment: 1.0 + 1e-3, 1000 times (sgd with lr 1e-3 on a gradient of -1)."""
    grad = -1.0
    # bf16 with an f32 master: the master sums to ~2.0, and round(master) is exactly 2.0.
    p_bf16 = jnp.ones(8, jnp.bfloat16)
    p, s = _run(optim.master_weights(optax.sgd(STEP)), p_bf16,
                jnp.full(8, grad, jnp.bfloat16), N_STEPS, _optax)
    assert p.dtype == jnp.bfloat16 and np.all(np.asarray(p, np.float32) == 2.0)
    np.testing.assert_allclose(np.asarray(s.master), 2.0, rtol=1e-4)  # f32 sum of 1000 terms
    # Plain bf16: 1e-3 is below half an ulp of 1.0 (2^-8), so nothing ever changes.
    p, _ = _run(optax.sgd(STEP), p_bf16, jnp.full(8, grad, jnp.bfloat16), N_STEPS, _optax)
    assert np.all(np.asarray(p, np.float32) == 1.0)
    assert _numpy_accumulate(ml_dtypes.bfloat16) == 1.0
    # Plain fp16: each step adds one ulp (2^-10 ~ 9.8e-4 < 1e-3): ~1.98, not 2.
    p, _ = _run(optax.sgd(STEP), jnp.ones(8, jnp.float16), jnp.full(8, grad, jnp.float16),
                N_STEPS, _optax)
    expected = _numpy_accumulate(np.float16)
    assert np.all(np.asarray(p, np.float32) == expected)
    assert expected == 1.0 + N_STEPS * 2.0**-10  # 1.9765625: by hand from the f16 spacing


def test_params_always_equal_rounded_master():
    key = jax.random.key(0)
    params = {"w_bf16": jax.random.normal(key, (64, 32)).astype(jnp.bfloat16),
              "w_f16": jax.random.normal(key, (32, 16)).astype(jnp.float16),
              "b": jnp.zeros(32, jnp.bfloat16), "scale": jnp.ones(32, jnp.float32)}
    opt = optim.master_weights(optim.adamw(3e-2, weight_decay=0.1))

    rng = np.random.default_rng(0)
    grads = {k: jnp.asarray(rng.standard_normal((20, *v.shape)), v.dtype)
             for k, v in params.items()}

    @jax.jit
    def run(p, grads):
        def body(carry, g):
            p, s = carry
            u, s = opt.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), (p, s.master, u)
        (p, s), hist = jax.lax.scan(body, (p, opt.init(p)), grads)
        return p, s, hist

    with jax.numpy_dtype_promotion("standard"):
        params, state, (p_hist, m_hist, u_hist) = run(params, grads)
    for name in ("w_bf16", "w_f16", "b"):
        np_dtype = np.dtype(params[name].dtype)
        master = np.asarray(m_hist[name])
        assert master.dtype == np.float32
        expected = master.astype(np_dtype)  # ml_dtypes / NumPy round-to-nearest-even
        np.testing.assert_array_equal(np.asarray(p_hist[name]), expected)
        assert u_hist[name].dtype == np.float32  # deltas in f32, exact under optax
        moved = np.diff(expected.astype(np.float32), axis=0) != 0
        assert moved.mean() > 0.5  # the parameters really move (not a vacuous comparison)
    assert isinstance(state.master["scale"], optax.MaskedNode)
    assert params["scale"].dtype == jnp.float32
    assert int(optim.param_mismatches(params, state)) == 0


def _one_update(dtype, m_old, u, rounding="nearest"):
    """One master_weights(sgd(1)) step from master ``m_old`` (params = round(m_old)) with
    update ``u``; returns (params before, new master, params after optax.apply_updates,
    state)."""
    p = m_old.astype(dtype)  # ml_dtypes / NumPy round-to-nearest-even
    opt = optim.master_weights(optax.sgd(1.0), rounding=rounding)
    state = opt.init(jnp.asarray(p))._replace(master=jnp.asarray(m_old))
    updates, state = jax.jit(opt.update)(jnp.asarray(-u), state, jnp.asarray(p))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(updates))
    master = np.asarray(state.master)
    np.testing.assert_array_equal(master, m_old + u)  # one f32 addition, as in NumPy
    return p, master, np.asarray(_apply(jnp.asarray(p), updates)), state


def _random_masters(rng, n, span):
    """f32 masters with magnitudes log-uniform in [e**-span, e**span], random signs."""
    return (np.exp(rng.uniform(-span, span, n)) * rng.choice([-1.0, 1.0], n)).astype(np.float32)


# bf16 shares f32's exponent range (e**±20 is far inside it); fp16's normal range is
# [6.1e-5, 65504]: e**±9 = [1.2e-4, 8103], so most relative updates up to e**3 stay finite.
@pytest.mark.parametrize("dtype,span", [(ml_dtypes.bfloat16, 20), (np.float16, 9)],
                         ids=["bf16", "fp16"])
def test_optax_apply_updates_lands_exactly_on_rounded_master(dtype, span):
    """The design claim: f32 deltas through plain optax.apply_updates give round(master) for
    relative updates from e**-30 to e**3 of either sign (sign changes and growth included)."""
    n = 400_000
    rng = np.random.default_rng(0)
    m_old = _random_masters(rng, n, span)
    r = np.exp(rng.uniform(-30.0, 3.0, n)) * rng.choice([-1.0, 1.0], n)
    u = (m_old.astype(np.float64) * r).astype(np.float32)
    p, master, new, state = _one_update(dtype, m_old, u)
    with np.errstate(over="ignore"):
        expected = master.astype(dtype)  # fp16: beyond 65504 is inf, in both
    np.testing.assert_array_equal(new, expected)
    assert int(optim.param_mismatches(jnp.asarray(new), state)) == 0
    # Not vacuous: bf16/fp16 deltas (the previous design) miss in a few percent of elements.
    with np.errstate(over="ignore", invalid="ignore"):
        low_delta = (expected.astype(np.float32) - p.astype(np.float32)).astype(dtype)
    old_way = np.asarray(_apply(jnp.asarray(p), jnp.asarray(low_delta)))
    finite = np.isfinite(expected.astype(np.float32))
    assert np.sum((old_way != expected) & finite) > n // 100
    # Stochastic rounding of the master: exact as well (the rounding is checked in
    # test_stochastic_rounding_of_the_master; here only that optax lands on it).
    _, _, new_sr, state_sr = _one_update(dtype, m_old, u, rounding="stochastic")
    assert int(optim.param_mismatches(jnp.asarray(new_sr), state_sr)) == 0


@pytest.mark.parametrize("dtype,span,spare_bits", [(ml_dtypes.bfloat16, 20, 16),
                                                   (np.float16, 9, 13)], ids=["bf16", "fp16"])
def test_the_documented_edge_case_large_shrink(dtype, span, spare_bits):
    """The one miss (module docstring): a parameter shrinking by more than 2**spare_bits
    (24 - significand bits) in one step, at a power of two. It lands within |p| * 2**-24 of
    round(master), and the next step, whose delta is again taken from the master, is exact."""
    n = 400_000
    rng = np.random.default_rng(1)
    m_old = _random_masters(rng, n, span)
    k = rng.uniform(0.0, 40.0, n)  # |new master| = |m_old| * 2**-k
    u = (m_old.astype(np.float64) * (2.0**-k * rng.choice([-1.0, 1.0], n) - 1.0)).astype(
        np.float32)
    p, master, new, state = _one_update(dtype, m_old, u)
    target = master.astype(dtype)
    pf, tf = p.astype(np.float64), target.astype(np.float64)
    miss = new != target
    assert 0 < miss.sum() < n // 1000  # it happens, rarely
    ratio = np.abs(tf[miss] / pf[miss])
    assert np.all(ratio < 2.0**-(spare_bits - 1))  # measured: < 2**-16 (bf16), 2**-13.3 (fp16)
    assert np.all(np.abs(np.frexp(pf[miss])[0]) == 0.5)  # p is a power of two
    assert np.all(np.abs(new[miss].astype(np.float64) - tf[miss]) <= np.abs(pf[miss]) * 2.0**-24)
    assert int(optim.param_mismatches(jnp.asarray(new), state)) == int(miss.sum())
    # The next update (zero gradient: the master stays) lands exactly.
    opt = optim.master_weights(optax.sgd(1.0))
    updates, state = jax.jit(opt.update)(jnp.zeros(n, jnp.float32), state, jnp.asarray(new))
    np.testing.assert_array_equal(np.asarray(_apply(jnp.asarray(new), updates)), target)


def test_add_updates_is_optax_apply_updates_and_strict_clean():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(4096) * np.exp(rng.uniform(-10, 10, 4096))
    pairs = [(p, u) for p in (jnp.bfloat16, jnp.float16, jnp.float32)
             for u in (jnp.bfloat16, jnp.float16, jnp.float32)]
    params = {f"{p.__name__}+{u.__name__}": jnp.asarray(x, p) for p, u in pairs}
    updates = {f"{p.__name__}+{u.__name__}": jnp.asarray(x[::-1] / 3, u) for p, u in pairs}
    ours = optim.add_updates(params, updates)  # strict promotion (the suite's): no error
    with pytest.raises(jax.dtypes.TypePromotionError):
        optax.apply_updates(params, updates)
    theirs = _apply(params, updates)
    for k in params:
        assert ours[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]), err_msg=k)
    assert optim.add_updates({"a": None, "b": jnp.ones(2)},
                             {"a": None, "b": jnp.ones(2)})["a"] is None


def test_skip_by_optax_apply_if_finite_inside_keeps_master_and_params():
    """apply_if_finite goes inside master_weights (module docstring): a skipped step leaves
    master and params unchanged."""
    params = jnp.array([1.0, -2.0, 0.5], jnp.bfloat16)
    opt = optim.master_weights(optax.apply_if_finite(optax.sgd(0.5), 5))
    state = opt.init(params)
    updates, state2 = opt.update(jnp.array([jnp.nan, 1.0, 1.0], jnp.bfloat16), state, params)
    np.testing.assert_array_equal(np.asarray(_apply(params, updates)), np.asarray(params))
    np.testing.assert_array_equal(np.asarray(state2.master), np.asarray(state.master))
    updates, _ = opt.update(jnp.array([2.0, 1.0, 1.0], jnp.bfloat16), state2, params)
    np.testing.assert_array_equal(np.asarray(_apply(params, updates)), [0.0, -2.5, 0.0])
    # Outside, with bf16 gradients, its lax.cond rejects the f32 deltas at trace time.
    outside = optax.apply_if_finite(optim.master_weights(optax.sgd(0.5)), 5)
    with pytest.raises(TypeError):
        outside.update(jnp.ones(3, jnp.bfloat16), outside.init(params), params)


def test_stochastic_rounding_of_the_master():
    n = 4096
    params = jnp.ones(n, jnp.bfloat16)
    opt = optim.master_weights(optax.sgd(STEP), rounding="stochastic", seed=3)
    p, s = _run(opt, params, jnp.full(n, -1.0, jnp.bfloat16), 300, _optax)
    master = np.asarray(s.master)
    assert np.all((master > 1.0) & (master < 2.0))  # bf16 spacing there: 2^-7
    ulp = 2.0**-7
    down = np.floor(master / ulp) * ulp  # the bf16 neighbours of the master
    pv = np.asarray(p, np.float32)
    assert np.all((pv == down) | (pv == down + ulp))
    # Unbiased: mean(p) ~ mean(master). Each element is a Bernoulli draw on the 2^-7 grid.
    frac = (master - down) / ulp
    sigma = ulp * np.sqrt(np.sum(frac * (1 - frac))) / n
    assert abs(pv.astype(np.float64).mean() - master.astype(np.float64).mean()) < 5 * sigma
    assert int(optim.param_mismatches(p, s)) == 0
    # Deterministic given the seed.
    p2, _ = _run(opt, params, jnp.full(n, -1.0, jnp.bfloat16), 300, _optax)
    np.testing.assert_array_equal(np.asarray(p2), pv)


def test_stochastic_round_updates_reach_two_in_expectation():
    n = 4096
    opt = optim.stochastic_round_updates(optax.sgd(STEP), seed=0)
    p, _ = _run(opt, jnp.ones(n, jnp.bfloat16), jnp.full(n, -1.0, jnp.bfloat16), N_STEPS, _optax)
    x = np.asarray(p, np.float64)
    step = float(ml_dtypes.bfloat16(STEP))  # sgd sees the bf16 update
    target = 1.0 + N_STEPS * step
    # Each step moves by one ulp (2^-7 below 2, 2^-6 above) with probability step / ulp: a
    # sum of ~1000 Bernoulli(0.13) ulps; the per-element sd is ~sqrt(1000*.13*.87)*2^-7.
    sd_elem = np.sqrt(N_STEPS * 0.13 * 0.87) * 2.0**-7 * 1.5  # 1.5: the ulp doubles at 2.0
    assert abs(x.mean() - target) < 5 * sd_elem / np.sqrt(n)
    assert 0.02 < x.std() < 2 * sd_elem  # it is random, and not wildly so


@pytest.mark.parametrize("comp_dtype", [None, jnp.float32])
def test_kahan_updates_reach_two(comp_dtype):
    opt = optim.kahan_updates(optax.sgd(STEP), compensation_dtype=comp_dtype)
    p, s = _run(opt, jnp.ones(8, jnp.bfloat16), jnp.full(8, -1.0, jnp.bfloat16), N_STEPS,
                _optax)
    step = float(ml_dtypes.bfloat16(STEP))  # sgd's bf16 update
    target = 1.0 + N_STEPS * step
    x = np.asarray(p, np.float32)
    total = x + np.asarray(s.compensation, np.float32)
    if comp_dtype is None:
        # A bf16 compensation rounds c + u every step (2^-16 spacing near c ~ 3e-3), with a
        # periodic, hence biased, pattern: p ends within one bf16 ulp (2^-6 at 2.0).
        assert s.compensation.dtype == jnp.bfloat16
        assert np.all(np.abs(x - target) <= 2.0**-6)
    else:
        # An f32 compensation keeps p + c on the exact sum (f32 rounding only), and p is
        # the sum rounded to within half a bf16 ulp (2^-7 at 2.0).
        np.testing.assert_allclose(total, target, atol=1e-5)
        assert np.all(np.abs(x - target) <= 2.0**-7)


def test_kahan_compensation_accounts_for_what_optax_applies():
    """Large relative updates (inexact bf16 deltas): the compensation still tracks the sum."""
    params = jnp.array([1e-3, -1e-3, 0.5, 3.0], jnp.bfloat16)
    opt = optim.kahan_updates(optax.sgd(1.0))
    state = opt.init(params)
    grads = jnp.array([-2.0, 0.7, -0.3, 1e-4], jnp.bfloat16)
    true = np.asarray(params, np.float64)
    p = params
    for _ in range(50):
        u, state = jax.jit(opt.update)(grads, state, p)
        p = optax.apply_updates(p, u)
        true = true - np.asarray(grads, np.float64)
    got = np.asarray(p, np.float64) + np.asarray(state.compensation, np.float64)
    np.testing.assert_allclose(got, true, rtol=2.0**-8, atol=1e-3)


def test_master_weights_on_f32_params_warns_and_passes_through():
    params = {"w": jnp.ones(3, jnp.float32)}
    opt = optim.master_weights(optax.sgd(1.0))
    with pytest.warns(UserWarning, match="nothing to keep a master copy"):
        state = opt.init(params)
    updates, state = opt.update({"w": jnp.ones(3, jnp.float32)}, state, params)
    np.testing.assert_array_equal(np.asarray(optim.add_updates(params, updates)["w"]),
                                  [0.0, 0.0, 0.0])


def test_update_requires_params():
    for opt in [optim.master_weights(optax.sgd(1.0)), optim.kahan_updates(optax.sgd(1.0)),
                optim.stochastic_round_updates(optax.sgd(1.0))]:
        p = jnp.ones(2, jnp.bfloat16)
        with pytest.raises(ValueError, match="params"):
            opt.update(p, opt.init(p))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rounding"):
        optim.master_weights(optax.sgd(1.0), rounding="up")
    with pytest.raises(TypeError, match="master_dtype"):
        optim.master_weights(optax.sgd(1.0), master_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="seed"):
        optim.master_weights(optax.sgd(1.0), rounding="stochastic", seed=1.5)
    with pytest.raises(TypeError, match="floating"):
        optim.master_weights(optax.sgd(1.0)).init({"a": jnp.ones(2, jnp.int32)})
    with pytest.raises(TypeError, match="compensation_dtype"):
        optim.kahan_updates(optax.sgd(1.0), compensation_dtype=jnp.int8)


def test_exactness_without_the_test_suites_xla_flag():
    """The suite runs with --xla_allow_excess_precision=false; users run with XLA's default
    (excess precision allowed). Kahan's compensation, the exact master rounding and the
    mismatch count must not depend on it."""
    code = """
import jax, jax.numpy as jnp, numpy as np, optax, ml_dtypes
from fmtkit import optim
opt = optim.kahan_updates(optax.sgd(1e-3))
def run(p):
    def body(c, _):
        p, s = c
        u, s = opt.update(-jnp.ones_like(p), s, p)
        return (optax.apply_updates(p, u), s), None
    return jax.lax.scan(body, (p, opt.init(p)), None, length=1000)[0]
p, s = jax.jit(run)(jnp.ones(4, jnp.bfloat16))
assert np.all(np.abs(np.asarray(p, np.float32) - 1.99945068359375) <= 2.0**-6), p
params = jax.random.normal(jax.random.key(1), (5000,)).astype(jnp.bfloat16)
mw = optim.master_weights(optax.sgd(0.1))
@jax.jit
def step(p, s, g):
    u, s = mw.update(g, s, p)
    new = optax.apply_updates(p, u)
    return new, s, optim.param_mismatches(new, s)
new, s, mism = step(params, mw.init(params), jnp.ones_like(params))
assert int(mism) == 0, int(mism)
assert np.array_equal(np.asarray(new), np.asarray(s.master).astype(ml_dtypes.bfloat16))
print("ok")
"""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_allow_excess_precision=false", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
