"""Dynamic / static loss scaling: GradScaler trace, Megatron hysteresis, clamps, skips,
state round trips, composition, bad input."""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fmtkit import optim
from fmtkit._switches import flipped

from ._reference import grad_scaler_trace

F16_MAX = float(ml_dtypes.finfo(np.float16).max)


def _bits(tree):
    """Leaves as raw bytes, for bit-identity checks (NaN-safe, -0-safe)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _f16_params():
    return {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float16), "n": jnp.ones(3, jnp.float32)}


def _step_fn(opt):
    @jax.jit
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.add_updates(params, updates), state, updates
    return step


# A scripted run of "true" gradient magnitudes; scaled by the current scale and rounded to
# f16 in NumPy, so overflows happen where f16 says they do (65504 is f16's max).
_SCRIPT = ([0.25] * 5 + [10.0] + [0.25] * 9 + [float("nan")] + [0.25] * 6 + [-float("inf")]
           + [1e-3] * 12 + [0.25] * 3)


def _scripted_run(opt, script, init_scale):
    """Feeds scaled f16 gradients; returns per-step (skipped, scale, tracker, hysteresis)."""
    params = _f16_params()
    state = opt.init(params)
    step = _step_fn(opt)
    scale, out, ovf = init_scale, [], []
    for g in script:
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = np.float16(np.float32(g) * np.float32(scale))  # inf beyond f16's max
        ovf.append(not np.isfinite(scaled))
        grads = {"w": jnp.full((8,), scaled, jnp.float16), "n": jnp.full((3,), 1e-3, jnp.float32)}
        before = state.skipped_steps
        params, state, _ = step(params, state, grads)
        scale = float(state.loss_scale)
        out.append((bool(state.skipped_steps > before), scale, int(state.growth_tracker),
                    int(state.hysteresis_tracker)))
    return out, ovf


def test_trace_matches_grad_scaler_reference():
    opt = optim.dynamic_loss_scale(optim.master_weights(optax.sgd(1e-3)), growth_interval=4)
    out, overflowed = _scripted_run(opt, _SCRIPT, 2.0**16)
    ref = grad_scaler_trace(overflowed, growth_interval=4)
    assert out == ref
    # The script really exercises growth, natural f16 overflow, NaN and -inf.
    scales = [s for _, s, _, _ in ref]
    assert max(scales) >= 2.0**17 and sum(overflowed) >= 4 and any(not o for o in overflowed)


def test_default_arguments_trace_over_4500_steps():
    """Defaults (2^16, x2 every 2000 finite steps, x0.5 on overflow): PyTorch, step by step."""
    n = 4500
    overflow = np.zeros(n, bool)
    overflow[[10, 11, 2600, 4499]] = True
    opt = optim.dynamic_loss_scale(optax.sgd(1e-3))
    params = jnp.zeros(4, jnp.float32)

    def body(state, ovf):
        g = jnp.where(ovf, jnp.float32(jnp.inf), jnp.float32(1.0)) * jnp.ones(4, jnp.float32)
        _, state = opt.update(g, state, params)
        return state, (state.loss_scale, state.growth_tracker, state.skipped_steps)

    _, (scale, tracker, skipped) = jax.jit(lambda s, o: jax.lax.scan(body, s, o))(
        opt.init(params), jnp.asarray(overflow))
    ref = grad_scaler_trace(overflow)
    np.testing.assert_array_equal(np.asarray(scale), [r[1] for r in ref])
    np.testing.assert_array_equal(np.asarray(tracker), [r[2] for r in ref])
    np.testing.assert_array_equal(np.diff(np.asarray(skipped), prepend=0), overflow)
    # 2^16 -> 2^14 (steps 10, 11) -> 2^15 (2000 finite steps later) -> 2^14 (step 2600).
    assert float(scale[2010]) == 2.0**14 and float(scale[2011]) == 2.0**15
    assert float(scale[-2]) == 2.0**14


@pytest.mark.parametrize("hysteresis", [2, 3])
def test_megatron_hysteresis(hysteresis):
    script = [0.25, 10.0, 0.25, 10.0, 10.0, 0.25, 0.25, 0.25, 0.25, 10.0, 10.0, 10.0, 0.25]
    opt = optim.dynamic_loss_scale(optim.master_weights(optax.sgd(1e-3)), init_scale=2.0**12,
                                   growth_interval=3, hysteresis=hysteresis)
    out, overflowed = _scripted_run(opt, script, 2.0**12)
    ref = grad_scaler_trace(overflowed, init_scale=2.0**12, growth_interval=3,
                            hysteresis=hysteresis)
    assert out == ref
    # Every overflow is skipped, but the scale backs off only once hysteresis is used up.
    assert all(s for s, *_ in (o for o, f in zip(out, overflowed) if f))
    assert out[1][1] == 2.0**12


def test_min_and_max_scale_clamp():
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, growth_interval=1,
                                   min_scale=2.0, max_scale=32.0)
    state = opt.init(jnp.zeros(2))
    update = jax.jit(opt.update)
    seen = []
    for finite in [False] * 4 + [True] * 6:
        g = jnp.full(2, 1.0 if finite else jnp.nan, jnp.float32)
        _, state = update(g, state, jnp.zeros(2))
        seen.append(float(state.loss_scale))
    assert seen == [4.0, 2.0, 2.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0, 32.0]


def test_growth_never_reaches_inf():
    big = float(np.finfo(np.float32).max) / 1.5
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=big, growth_interval=1)
    state = opt.init(jnp.zeros(1))
    _, state = opt.update(jnp.zeros(1), state)
    assert float(state.loss_scale) == np.float32(big)
    assert int(state.growth_tracker) == 0


def test_skipped_step_is_bit_identical():
    params = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), "n": jnp.ones(4, jnp.float32)}
    opt = optim.dynamic_loss_scale(optim.master_weights(optim.adamw(1e-2)), init_scale=4.0)
    state = opt.init(params)
    step = _step_fn(opt)
    good = {"w": jnp.full(16, 0.5, jnp.bfloat16), "n": jnp.full(4, 0.5, jnp.float32)}
    for _ in range(3):  # some history in the inner state
        params, state, _ = step(params, state, good)
    bad = {"w": good["w"].at[3].set(jnp.inf), "n": good["n"]}
    new_params, new_state, updates = step(params, state, bad)
    assert _bits(new_params) == _bits(params)
    assert _bits(new_state.inner_state) == _bits(state.inner_state)
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert [u.dtype for u in jax.tree.leaves(updates)] == [jnp.float32] * 2  # inner's dtypes
    assert float(new_state.loss_scale) == 2.0 and int(new_state.skipped_steps) == 1
    assert bool(new_state.last_step_skipped) and not bool(state.last_step_skipped)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_every_non_finite_element_is_detected(dtype):
    # A large leaf (vectorised reductions) and a small one; each bad value in several places.
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0)
    base = {"a": jnp.full((64 * 129,), 3.0, dtype), "b": jnp.full((5,), -2.0, dtype)}
    update = jax.jit(opt.update)
    state = opt.init(base)
    _, ok = update(base, state)
    assert int(ok.skipped_steps) == 0
    for bad in [np.inf, -np.inf, np.nan]:
        for leaf, where in [("a", 0), ("a", 4097), ("a", -1), ("b", 2)]:
            grads = dict(base, **{leaf: base[leaf].at[where].set(bad)})
            _, new = update(grads, state)
            assert int(new.skipped_steps) == 1, (bad, leaf, where)


def test_largest_finite_f16_gradients_are_not_an_overflow():
    g = jnp.full((4096,), F16_MAX, jnp.float16)
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0)
    _, state = jax.jit(opt.update)(g, opt.init(g))
    assert int(state.skipped_steps) == 0


def test_unscale_uses_the_float64_reciprocal_rounded_to_f32():
    """PyTorch unscales with ``scale.double().reciprocal().float()``; f32 division equals it."""
    rng = np.random.default_rng(0)
    scales = np.exp(rng.uniform(-40, 40, 2000)).astype(np.float32)
    g = rng.standard_normal(2000).astype(np.float32)
    expected = g * (1.0 / scales.astype(np.float64)).astype(np.float32)
    got = jax.jit(jax.vmap(lambda gi, si: optim.unscale_grads(
        gi, optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0).init(gi)._replace(
            loss_scale=si))))(g, scales)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_state_survives_jit_cond_and_keeps_min_scale():
    """jmp PR #44: its min_loss_scale was lost crossing jit. Ours is a closure constant."""
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, min_scale=2.0)
    state = jax.jit(lambda s: s)(opt.init(jnp.zeros(2)))
    state = jax.jit(lambda p, s: jax.lax.cond(p, lambda: s, lambda: s))(True, state)
    for _ in range(3):
        _, state = jax.jit(opt.update)(jnp.full(2, jnp.inf), state)
    assert float(state.loss_scale) == 2.0
    assert jax.tree.map(lambda x: x.dtype, state) == jax.tree.map(
        lambda x: x.dtype, opt.init(jnp.zeros(2)))


def test_f16_init_scale_is_kept_in_f32():
    """jmp #47 broke with an f16 scale; ours is always an f32 array."""
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=np.float16(1024))
    state = opt.init(jnp.zeros(2, jnp.float16))
    assert state.loss_scale.dtype == jnp.float32
    scaled = optim.scale_loss(jnp.float16(60000.0), state)  # overflows f16, not f32
    assert scaled.dtype == jnp.float32 and float(scaled) == 60000.0 * 1024


def test_checkpoint_restore_is_exact(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.float16), "n": jnp.ones(4, jnp.float32)}
    opt = optim.dynamic_loss_scale(
        optim.master_weights(optim.adamw(1e-2, mu_dtype="bf16", rounding="stochastic"),
                             rounding="stochastic"),
        init_scale=2.0**10, growth_interval=2, min_scale=1.0, hysteresis=2)
    step = _step_fn(opt)
    state = opt.init(params)
    grads = {"w": jnp.full(16, 3.0, jnp.float16), "n": jnp.full(4, 0.1, jnp.float32)}
    for g in [grads, jax.tree.map(lambda x: x * jnp.inf, grads), grads, grads, grads]:
        params, state, _ = step(params, state, g)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state",
                            jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert _bits(restored) == _bits(state)
    # And both continue identically (stochastic rounding included).
    a = step(params, state, grads)
    b = step(params, restored, grads)
    assert _bits(a) == _bits(b)


def test_static_loss_scale():
    opt = optim.static_loss_scale(optax.sgd(1.0), scale=128.0)
    state = opt.init(jnp.zeros(2, jnp.float32))
    updates, state = opt.update(jnp.array([128.0, -256.0], jnp.float32), state)
    np.testing.assert_array_equal(np.asarray(updates), [-1.0, 2.0])
    assert not bool(state.last_step_skipped)
    updates, state = opt.update(jnp.array([jnp.nan, 1.0], jnp.float32), state)
    np.testing.assert_array_equal(np.asarray(updates), [0.0, 0.0])
    assert float(optim.loss_scale(state)) == 128.0 and int(state.skipped_steps) == 1
    assert bool(state.last_step_skipped)


def test_loss_scale_found_through_wrappers():
    inner = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=32.0)
    p = jnp.zeros(2)
    with jax.numpy_dtype_promotion("standard"), pytest.warns(UserWarning, match="MultiSteps"):
        ms = optax.MultiSteps(inner, 2).init(p)  # not strict-clean; warned about, see below
    for state in [inner.init(p), optax.chain(optax.identity(), inner).init(p), ms,
                  optax.apply_if_finite(inner, 3).init(p),
                  optim.multi_steps(inner, every_k=4).init(p)]:
        assert float(optim.loss_scale(state)) == 32.0
    with pytest.raises(ValueError, match="no loss scale"):
        optim.loss_scale(optax.sgd(1.0).init(p))
    assert float(optim.loss_scale(optax.sgd(1.0).init(p), default=1.0)) == 1.0
    two = optax.chain(inner, optim.static_loss_scale(optax.sgd(1.0), scale=2.0)).init(p)
    with pytest.raises(ValueError, match="2 loss scales"):
        optim.loss_scale(two)
    tree_get = optax.tree_utils.tree_get(inner.init(p), "loss_scale")
    assert float(tree_get) == 32.0


def test_scale_and_unscale_helpers():
    state = optim.static_loss_scale(optax.sgd(1.0), scale=8.0).init(jnp.zeros(1))
    assert float(optim.scale_loss(jnp.float16(0.5), state)) == 4.0
    grads = {"a": jnp.array([8.0, 16.0], jnp.float16)}
    un = optim.unscale_grads(grads, state)
    assert un["a"].dtype == jnp.float32 and un["a"].tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="loss"):
        optim.scale_loss(jnp.int32(3), state)


def test_clipping_after_unscaling_in_a_chain():
    """dynamic_loss_scale(chain(clip, sgd)) clips the *unscaled* gradients."""
    opt = optim.dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                                   init_scale=1024.0)
    g = jnp.array([3.0, 4.0], jnp.float32) * 1024.0  # unscaled norm 5 -> clipped to 1
    updates, _ = opt.update(g, opt.init(jnp.zeros(2)))
    np.testing.assert_allclose(np.asarray(updates), [-0.6, -0.8], rtol=1e-6)


def test_apply_if_finite_composes():
    opt = optax.apply_if_finite(optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0), 2)
    state = opt.init(jnp.zeros(2))
    updates, state = opt.update(jnp.array([jnp.inf, 1.0]), state)
    assert float(optim.loss_scale(state)) == 4.0  # the outer wrapper skipped first
    assert int(state.notfinite_count) == 1 and not np.any(np.asarray(updates))
    updates, state = opt.update(jnp.array([4.0, 8.0]), state)
    np.testing.assert_array_equal(np.asarray(updates), [-1.0, -2.0])


def _accumulation_run(make, script, k, standard):
    """Micro-batch gradients (scaled by the current scale in f16); per micro-step records."""
    opt = make(optim.dynamic_loss_scale(optim.master_weights(optax.sgd(1.0)),
                                        init_scale=2.0**8, growth_interval=2), k)
    params = jnp.ones(4, jnp.float16)
    ctx = jax.numpy_dtype_promotion("standard" if standard else "strict")
    with ctx, warnings.catch_warnings():
        # optax.MultiSteps around a loss scaler warns (see test_optax_multisteps_is_detected)
        warnings.filterwarnings("ignore", "dynamic_loss_scale is wrapped by optax.MultiSteps")
        state = opt.init(params)
        step = _step_fn(opt)
        rows = []
        for g in script:
            s = float(optim.loss_scale(state))
            with np.errstate(over="ignore"):
                scaled = np.float16(np.float32(g) * np.float32(s))  # inf beyond f16's max
            grads = jnp.full(4, scaled, jnp.float16)
            params, state, _ = step(params, state, grads)
            rows.append((s, float(optim.loss_scale(state)), float(params[0])))
    return rows


def _fmtkit_multi_steps(opt, k):
    return optim.multi_steps(opt, every_k=k)


@pytest.mark.parametrize("make,standard", [(optax.MultiSteps, True),
                                           (_fmtkit_multi_steps, False)],
                         ids=["optax.MultiSteps", "fmtkit.multi_steps"])
def test_accumulation_scale_constant_over_micro_steps(make, standard):
    """PyTorch's AMP accumulation: the scale changes only at effective-batch boundaries, and
    one unscale/check/update happens per effective batch."""
    k = 3
    script = [2.0**-10] * 12  # finite throughout: growth after 2 effective batches
    rows = _accumulation_run(make, script, k, standard)
    scales_used = [r[0] for r in rows]
    assert scales_used == [256.0] * 6 + [512.0] * 6
    # Parameters move once per effective batch (sgd lr 1 on the mean unscaled gradient).
    moved = [i for i in range(1, len(rows)) if rows[i][2] != rows[i - 1][2]]
    assert moved == [2, 5, 8, 11] and rows[1][2] == 1.0


def test_optax_multisteps_overflow_poisons_the_accumulator():
    """Documents optax 0.2.8: after an effective batch with inf, ``(1 - emit) * acc`` leaves
    NaN in the accumulator, so every later batch is skipped (the reason for multi_steps).
    If optax fixes this, this test fails: then drop the warning from the docs."""
    script = [1.0, 2.0**20, 1.0] + [2.0**-10] * 9  # micro-step 2 overflows f16
    rows = _accumulation_run(optax.MultiSteps, script, 3, True)
    assert rows[2][1] == 128.0  # the overflowing batch backed off once
    assert [r[1] for r in rows[3:]][-1] < 128.0 / 2  # and it keeps backing off: poisoned


def test_fmtkit_multi_steps_recovers_after_an_overflow():
    script = [1.0, 2.0**20, 1.0] + [2.0**-10] * 9
    rows = _accumulation_run(_fmtkit_multi_steps, script, 3, False)
    after = [r[1] for r in rows]
    # GradScaler once per effective batch: overflow, then finite batches.
    ref = grad_scaler_trace([True, False, False, False], init_scale=2.0**8, growth_interval=2)
    expected, scale = [], 2.0**8
    for i in range(len(script)):
        if i % 3 == 2:
            scale = ref[i // 3][1]
        expected.append(scale)
    assert after == expected and after[2] == 128.0 and after[-1] == 256.0
    assert rows[5][2] != rows[4][2]  # the next effective batch applied


def test_inner_optimizer_built_on_low_precision_params_is_rejected():
    params = jnp.ones(4, jnp.bfloat16)
    opt = optim.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))  # bf16 momentum trace
    state = opt.init(params)
    with jax.numpy_dtype_promotion("standard"), pytest.raises(TypeError, match="master"):
        opt.update(jnp.ones(4, jnp.bfloat16), state, params)


def test_integer_gradients_are_rejected():
    opt = optim.dynamic_loss_scale(optax.sgd(1.0))
    with pytest.raises(TypeError, match="floating"):
        opt.update({"a": jnp.ones(2, jnp.int32)}, opt.init({"a": jnp.ones(2)}))


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(growth_factor=1.0), ValueError, "growth_factor"),
    (dict(growth_factor=0.5), ValueError, "growth_factor"),
    (dict(backoff_factor=1.0), ValueError, "backoff_factor"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor"),
    (dict(backoff_factor=-0.5), ValueError, "backoff_factor"),
    (dict(growth_interval=0), ValueError, "growth_interval"),
    (dict(growth_interval=-3), ValueError, "growth_interval"),
    (dict(growth_interval=2.5), TypeError, "growth_interval"),
    (dict(init_scale=0.0), ValueError, "init_scale"),
    (dict(init_scale=-1.0), ValueError, "init_scale"),
    (dict(init_scale=math.inf), ValueError, "init_scale"),
    (dict(init_scale=math.nan), ValueError, "init_scale"),
    (dict(init_scale=1e39), ValueError, "init_scale"),
    (dict(init_scale="big"), TypeError, "init_scale"),
    (dict(hysteresis=0), ValueError, "hysteresis"),
    (dict(min_scale=2.0**17), ValueError, "min_scale"),
    (dict(max_scale=2.0), ValueError, "max_scale"),
    (dict(min_scale=0.0), ValueError, "min_scale"),
])
def test_bad_hyperparameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        optim.dynamic_loss_scale(optax.sgd(1.0), **kwargs)


@pytest.mark.parametrize("scale", [0.0, -2.0, math.inf, math.nan])
def test_bad_static_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        optim.static_loss_scale(optax.sgd(1.0), scale=scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_huge_finite_gradients_whose_sum_overflows_are_not_an_overflow(dtype):
    """The fast f32 sum of two finite 3e38 entries overflows; the elementwise fallback of
    all_finite then decides, as PyTorch's elementwise test does: finite, not skipped."""
    g = jnp.array([3e38, 3e38, 1.0], dtype)
    opt = optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0)
    _, state = jax.jit(opt.update)(g, opt.init(g))
    assert int(state.skipped_steps) == 0 and not bool(state.last_step_skipped)
    assert bool(optim.all_finite(g)) and not bool(optim.all_finite(g.at[2].set(jnp.nan)))


@pytest.mark.parametrize("make", [
    lambda inner: optim.dynamic_loss_scale(inner, init_scale=2.0**8, growth_interval=3),
    lambda inner: optim.static_loss_scale(inner, scale=2.0**8)], ids=["dynamic", "static"])
def test_last_step_skipped_follows_every_step(make):
    """The state says whether the step that produced it was skipped; through jit and scan."""
    rng = np.random.default_rng(0)
    bad = rng.random(64) < 0.3
    grads = np.where(bad[:, None], np.inf, 1.0) * np.ones((64, 4), np.float32)
    grads[bad & (rng.random(64) < 0.5), 1] = np.nan
    opt = make(optim.master_weights(optax.sgd(1e-3)))
    params = jnp.ones(4, jnp.bfloat16)

    def body(state, g):
        _, state = opt.update(g.astype(jnp.bfloat16), state, params)
        return state, (state.last_step_skipped, state.skipped_steps)

    _, (skipped, count) = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(
        opt.init(params), jnp.asarray(grads))
    assert skipped.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(skipped), bad)
    np.testing.assert_array_equal(np.asarray(count), np.cumsum(bad))


def test_optax_multisteps_is_detected():
    """optax.MultiSteps around a loss scaler (directly or deeper in a chain) warns at init and
    when update is traced; fmtkit's multi_steps does not."""
    p = jnp.ones(4, jnp.float32)
    for inner in [optim.dynamic_loss_scale(optax.sgd(1.0)),
                  optax.chain(optax.clip(1.0), optim.static_loss_scale(optax.sgd(1.0),
                                                                       scale=4.0))]:
        opt = optax.MultiSteps(inner, 2)
        with jax.numpy_dtype_promotion("standard"):
            with pytest.warns(UserWarning, match="fmtkit.optim.multi_steps"):
                state = opt.init(p)
            with pytest.warns(UserWarning, match="optax.MultiSteps"):
                jax.jit(opt.update)(p, state, p)
    ours = optim.multi_steps(optim.dynamic_loss_scale(optax.sgd(1.0)), every_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(ours.update)(p, ours.init(p), p)


def test_hyperparameters_are_keyword_only():
    with pytest.raises(TypeError):
        optim.dynamic_loss_scale(optax.sgd(1.0), 2.0**10)
    with pytest.raises(TypeError):
        optim.static_loss_scale(optax.sgd(1.0), 8.0)
    with pytest.raises(TypeError):
        optim.multi_steps(optax.sgd(1.0), 2)
    with pytest.raises(TypeError):
        optim.scale_by_adam(0.9)
    with pytest.raises(TypeError):
        optim.adamw(1e-3, 0.9)
    with pytest.raises(TypeError):
        optim.loss_scale(optax.sgd(1.0).init(jnp.zeros(1)), 1.0)


# ---------------------------------------------------------------------------------------------
# master_weights under a loss scaler: the deltas are computed after the skip cond (speed), with
# the same results as computing them inside it


def _one_part(opt):
    """``opt`` with its update hidden behind a plain function: the loss scaler then runs the
    whole inner update under its cond (the general path)."""
    return optax.GradientTransformationExtraArgs(opt.init, lambda *a, **k: opt.update(*a, **k))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_master_weights_deltas_after_the_cond_equal_the_one_part_path(rounding):
    params = {"w": jnp.linspace(-1, 1, 24, dtype=jnp.bfloat16).reshape(4, 6),
              "h": jnp.linspace(-2, 3, 5, dtype=jnp.float16), "n": jnp.ones(4, jnp.float32)}
    results = []
    for wrap in (lambda o: o, _one_part):
        mw = wrap(optim.master_weights(optim.adamw(1e-2), rounding=rounding, seed=3))
        opt = optim.dynamic_loss_scale(mw, init_scale=2.0**10, growth_interval=3)
        p, state, step, trace = params, opt.init(params), _step_fn(opt), []
        for i in range(8):
            g = jax.tree.map(lambda x, v=0.3 * (i + 1): jnp.full(x.shape, v, x.dtype), p)
            if i == 4:  # an overflow: a skipped step in the middle
                g = dict(g, h=g["h"].at[1].set(jnp.inf))
            p, state, updates = step(p, state, g)
            trace.append(_bits((p, state, updates)))
        results.append(trace)
    assert results[0] == results[1]


def test_skipped_step_returns_zeros_when_params_differ_from_round_master():
    # Parameters changed behind the optimizer's back: round(master) - p is not zero, yet a
    # skipped step must still return exact zeros (the deltas are selected, not recomputed).
    params = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), "n": jnp.ones(4, jnp.float32)}
    opt = optim.dynamic_loss_scale(optim.master_weights(optax.sgd(1e-2)))
    state = opt.init(params)
    moved = {"w": params["w"] + jnp.bfloat16(0.25), "n": params["n"]}
    bad = {"w": jnp.full(16, jnp.nan, jnp.bfloat16), "n": jnp.ones(4, jnp.float32)}
    updates, new_state = jax.jit(opt.update)(bad, state, moved)
    assert bool(new_state.last_step_skipped)
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert _bits(new_state.inner_state) == _bits(state.inner_state)


def _param_sized_copies(opt, params, grads) -> int:
    """``copy`` instructions of a parameter's shape in the compiled, donated step."""
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.add_updates(params, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, opt.init(params), grads).compile()
    return sum(1 for line in compiled.as_text().splitlines()
               if re.search(r"\[96,80\]\S* copy\(", line))


def test_compiled_master_weights_step_has_no_parameter_sized_copy():
    # dynamic_loss_scale(master_weights(adamw)), donated: the skip branch returns the state
    # as it is and no delta buffer, so XLA copies nothing parameter-sized.
    params = {f"w{i}": jnp.full((96, 80), 0.5, jnp.bfloat16) for i in range(3)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 8.0, jnp.bfloat16), params)
    mw = optim.master_weights(optim.adamw(1e-3))
    assert _param_sized_copies(optim.dynamic_loss_scale(mw), params, grads) == 0
    # Negative control: the whole inner update under the cond (its skip branch returns
    # parameter-sized zeros) makes XLA copy them.
    assert _param_sized_copies(optim.dynamic_loss_scale(_one_part(mw)), params, grads) > 0


# ---------------------------------------------------------------------------------------------
# optax.inject_hyperparams around the wrappers: numeric hyperparameters arrive as arrays
# (traced under jit) and can be changed in the state between steps


def test_inject_hyperparams_dynamic_loss_scale_follows_changed_hyperparameters():
    inner = optim.master_weights(optax.sgd(0.5))
    opt = optax.inject_hyperparams(optim.dynamic_loss_scale, hyperparam_dtype=jnp.float32)(
        inner, init_scale=16.0, growth_interval=2, backoff_factor=0.5)
    direct = optim.dynamic_loss_scale(inner, init_scale=16.0, growth_interval=2,
                                      backoff_factor=0.5)
    params = jnp.linspace(-1, 1, 4, dtype=jnp.bfloat16)
    state, ref_state = opt.init(params), direct.init(params)
    assert state.hyperparams["growth_interval"].dtype == jnp.int32
    step, ref_step = _step_fn(opt), _step_fn(direct)
    g, bad = jnp.full(4, 32.0, jnp.bfloat16), jnp.full(4, jnp.inf, jnp.bfloat16)
    p, ref_p, scales = params, params, []
    for grads in (g, g, bad):  # the same trajectory as the un-injected transformation
        p, state, u = step(p, state, grads)
        ref_p, ref_state, ref_u = ref_step(ref_p, ref_state, grads)
        assert _bits((p, state.inner_state, u)) == _bits((ref_p, ref_state, ref_u))
        scales.append(float(optim.loss_scale(state)))
    # New values in the state, no retrace needed: backoff x0.25 and growth after every step.
    state.hyperparams.update(backoff_factor=jnp.float32(0.25),
                             growth_interval=jnp.int32(1))
    for grads in (bad, g):
        p, state, u = step(p, state, grads)
        scales.append(float(optim.loss_scale(state)))
    # Hand-derived from the definitions: 16 (1 of 2 finite steps), x2 on the 2nd, x0.5 on
    # an overflow; then x0.25 on an overflow, x2 after the next finite step (interval 1).
    assert scales == [16.0, 32.0, 16.0, 4.0, 8.0]
    assert int(state.inner_state.skipped_steps) == 2


def test_inject_hyperparams_static_scale_master_weights_and_multi_steps():
    params = jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16)
    grads = [jnp.full(6, 0.1 * (i + 1), jnp.bfloat16) for i in range(4)]
    inject = optax.inject_hyperparams
    pairs = [  # (injected, direct): bit-identical updates and states over four steps
        (inject(optim.static_loss_scale)(optax.sgd(0.5), scale=8.0),
         optim.static_loss_scale(optax.sgd(0.5), scale=8.0)),
        (inject(optim.master_weights)(optax.sgd(0.5), rounding="stochastic", seed=3),
         optim.master_weights(optax.sgd(0.5), rounding="stochastic", seed=3)),
        (inject(optim.multi_steps)(optim.master_weights(optax.sgd(0.5)), every_k=2),
         optim.multi_steps(optim.master_weights(optax.sgd(0.5)), every_k=2)),
    ]
    for opt, direct in pairs:
        s, ref_s = opt.init(params), direct.init(params)
        step, ref_step = _step_fn(opt), _step_fn(direct)
        p = ref_p = params
        for g in grads:
            p, s, u = step(p, s, g)
            ref_p, ref_s, ref_u = ref_step(ref_p, ref_s, g)
            assert _bits((p, s.inner_state, u)) == _bits((ref_p, ref_s, ref_u))
    assert float(optim.loss_scale(pairs[0][0].init(params))) == 8.0
    # multi_steps' every_k changed in the state: the next emit comes after three micro-steps
    opt = pairs[2][0]
    s = opt.init(params)
    s.hyperparams["every_k"] = jnp.int32(3)
    step = _step_fn(opt)
    emitted = []
    for g in grads[:3]:
        _, s, u = step(params, s, g)
        emitted.append(bool(np.any(np.asarray(u))))
    assert emitted == [False, False, True]


def test_inject_hyperparams_learning_rate_of_the_whole_chain():
    """The learning rate of the inner adamw, injected around the whole chain (constant or a
    schedule): the same steps as the chain built with that learning rate."""
    def chain(learning_rate):
        return optim.dynamic_loss_scale(optim.master_weights(optim.adamw(learning_rate)),
                                        init_scale=2.0**10)

    params = jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16)
    grads = jnp.linspace(-64.0, 64.0, 8, dtype=jnp.bfloat16)
    injected = optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)
    for lr in (1e-3, 2e-2):
        opt, direct = injected(learning_rate=lr), chain(np.float32(lr))
        s, ref_s = opt.init(params), direct.init(params)
        step, ref_step = _step_fn(opt), _step_fn(direct)
        p = ref_p = params
        for _ in range(3):
            p, s, u = step(p, s, grads)
            ref_p, ref_s, ref_u = ref_step(ref_p, ref_s, grads)
            assert _bits((p, s.inner_state, u)) == _bits((ref_p, ref_s, ref_u))
    sched = injected(learning_rate=optax.linear_schedule(1e-2, 0.0, 2))
    p, s, step, moved = params, sched.init(params), _step_fn(sched), []
    for _ in range(3):  # learning rates 1e-2, 5e-3, then 0: the parameters stop moving
        p, s, u = step(p, s, grads)
        moved.append(bool(np.any(np.asarray(u))))
    assert moved == [True, True, False]


def test_inject_hyperparams_bad_values_and_dtype_arguments():
    """Concrete hyperparameters are still validated (at init); a dtype given as jnp.float32
    (a callable, which inject_hyperparams treats as a schedule) gets an error naming it."""
    params = jnp.ones(4, jnp.bfloat16)
    inject = optax.inject_hyperparams
    with pytest.raises(ValueError, match="growth_factor must be > 1"):
        inject(optim.dynamic_loss_scale)(optax.sgd(1.0), growth_factor=0.5).init(params)
    with pytest.raises(ValueError, match="every_k must be a positive int"):
        inject(optim.multi_steps)(optax.sgd(1.0), every_k=0).init(params)
    with pytest.raises(TypeError, match="growth_interval must be a positive int"):
        optim.dynamic_loss_scale(optax.sgd(1.0), growth_interval=jnp.float32(3.0))
    with pytest.raises(ValueError, match="init_scale must be a scalar"):
        optim.dynamic_loss_scale(optax.sgd(1.0), init_scale=jnp.ones(2))
    for make, name in [(optim.master_weights, "master_dtype"),
                       (optim.multi_steps, "accumulator_dtype")]:
        kwargs = {name: jnp.float32, **({"every_k": 2} if name == "accumulator_dtype" else {})}
        with pytest.raises(TypeError, match=f"{name} must be a dtype.*static_args"):
            inject(make)(optax.sgd(1.0), **kwargs).init(params)
        # a string, or the name in static_args, works
        inject(make)(optax.sgd(1.0), **{**kwargs, name: "float32"}).init(params)
        inject(make, static_args=(name,))(optax.sgd(1.0), **kwargs).init(params)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_exact_fallback_of_all_finite_when_the_fast_sum_overflows(dtype):
    """Finite elements whose f32 sum overflows send all_finite to its exact test (the sum of
    x - x); with an inf, -inf, both, or a NaN anywhere it must still say False, and True
    without. Reference: NumPy's elementwise isfinite."""
    check = jax.jit(optim.all_finite)
    big = np.full(4096, 3e38, np.float32)
    big[::3] = -3e38  # partial sums overflow both ways
    for bad in [None, np.inf, -np.inf, np.nan, "both"]:
        for where in [0, 2049, 4095]:
            a = big.copy()
            if bad == "both":
                a[where], a[(where + 7) % 4096] = np.inf, -np.inf
            elif bad is not None:
                a[where] = bad
            leaves = [jnp.asarray(a).astype(dtype), jnp.asarray(a[:5]).astype(dtype)]
            want = bool(np.all(np.isfinite(np.asarray(leaves[0], np.float32))))
            assert bool(check(leaves)) is want, (bad, where)


def test_all_finite_allocates_no_parameter_sized_temporary():
    # The exact fallback (x - x summed) fuses into its reductions; a fallback built on
    # all(isfinite(x)) made XLA:CPU allocate a bool array per leaf on every step.
    params = {f"w{i}": jnp.full((96, 80), 0.5, jnp.bfloat16) for i in range(3)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 8.0, jnp.bfloat16), params)

    def temp_bytes():
        opt = optim.dynamic_loss_scale(optim.master_weights(optim.adamw(1e-3)))

        def step(params, state, grads):
            updates, state = opt.update(grads, state, params)
            return optim.add_updates(params, updates), state

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            params, opt.init(params), grads).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes() < 96 * 80  # less than one bool array of a parameter's shape
    with flipped(fused_finite_fallback=False):  # negative control: the previous fallback
        assert temp_bytes() >= 3 * 96 * 80
