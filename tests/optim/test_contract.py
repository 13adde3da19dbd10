"""One contract test over every transformation in fmtkit.optim (optax contrib/_common_test
style): jit, update dtypes (the gradients' dtype, or float32 where a transformation returns
float32 deltas on purpose), parameters keep their dtypes through optax.apply_updates, state
structure/dtype stability through lax.cond, composition with optax.chain, optax.MultiSteps
(warned about around a loss scaler) and fmtkit's multi_steps, one trace.

The stochastic-rounding options of master_weights and scale_by_adam have the same state
structure plus an int32 seed; their state is round-tripped in test_loss_scale's checkpoint
test, and they are left out here to keep the compile time down."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import rtol

from fmtkit import ScaledArray, TensorScaling, optim

TRANSFORMS = {
    "dynamic_loss_scale": lambda: optim.dynamic_loss_scale(optax.sgd(1e-2), init_scale=4.0),
    "static_loss_scale": lambda: optim.static_loss_scale(optax.sgd(1e-2), scale=4.0),
    "master_weights": lambda: optim.master_weights(optim.adamw(1e-2)),
    "stochastic_round_updates": lambda: optim.stochastic_round_updates(optax.sgd(1e-2)),
    "kahan_updates": lambda: optim.kahan_updates(optax.sgd(1e-2)),
    "scale_by_adam_bf16": lambda: optim.scale_by_adam(mu_dtype="bf16", nu_dtype="bf16"),
    "adamw_fp8_msamp": lambda: optim.adamw(1e-2, mu_dtype="e4m3", nu_dtype="fp16",
                                           nu_scaling=TensorScaling()),
    "multi_steps": lambda: optim.multi_steps(optax.sgd(1e-2), every_k=2),
    "full_stack": lambda: optim.dynamic_loss_scale(optim.master_weights(optim.adamw(1e-2)),
                                                   init_scale=4.0),
}


# Transformations whose updates for the bf16 parameter "w" (bf16 gradients) are float32: the
# loss scalers return what their inner optimizer gives for the float32 unscaled gradients,
# master_weights and stochastic_round_updates return float32 deltas (exact under
# optax.apply_updates). The others keep the gradients' dtype.
F32_UPDATES = {"dynamic_loss_scale", "static_loss_scale", "master_weights",
               "stochastic_round_updates", "full_stack"}
LOSS_SCALED = {"dynamic_loss_scale", "static_loss_scale", "full_stack"}


def _update_avals(name, params):
    return {k: (v.shape, jnp.dtype(jnp.float32) if name in F32_UPDATES else v.dtype)
            for k, v in params.items()}


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 4 * 32, dtype=jnp.float32).reshape(4, 32).astype(
                jnp.bfloat16),
            "b": jnp.linspace(0.5, 1.5, 32, dtype=jnp.float32)}


def _grads(i=0):
    return {"w": jnp.full((4, 32), 0.25 + i, jnp.bfloat16), "b": jnp.full(32, -0.5, jnp.float32)}


def _avals(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _changed(a, b):
    return any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _compositions(opt, params):
    """Everything but the step, in one jitted function (one compile per case); also returns
    the messages of the warnings raised while tracing it."""

    def run(params):
        state0 = opt.init(params)
        u_plain, state1 = opt.update(_grads(), state0, params)
        # Through lax.cond: both branches must have identical types.
        picked = jax.lax.cond(jnp.bool_(True), lambda: state1, lambda: state0)
        # In optax.chain, behind an identity: the same updates.
        chained = optax.chain(optax.identity(), opt)
        u_chain, _ = chained.update(_grads(), chained.init(params), params)
        # Inside gradient accumulation (every 2 micro-steps): fmtkit's and optax's.
        accumulated = {}
        for name, promotion in [("fmtkit", "strict"), ("optax", "standard")]:
            with jax.numpy_dtype_promotion(promotion):  # optax.MultiSteps is not strict-clean
                acc = (optim.multi_steps(opt, every_k=2) if name == "fmtkit"
                       else optax.MultiSteps(opt, 2))
                s = s0 = acc.init(params)
                p = params
                for i in range(4):
                    u, s = acc.update(_grads(i), s, p)
                    p = optim.add_updates(p, u)
                accumulated[name] = (u, p, s, s0)
        return state1, picked, u_plain, u_chain, accumulated

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.jit(run)(params)
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_contract(name):
    opt = TRANSFORMS[name]()
    params = _params()
    traces = []

    @jax.jit
    def step(p, s, g):
        traces.append(1)
        u, s = opt.update(g, s, p)
        return optim.add_updates(p, u), s, u

    state0 = opt.init(params)
    state, p = state0, params
    for i in range(3):
        p, state, updates = step(p, state, _grads(i))
        # Update dtypes as documented; params keep each leaf's dtype and shape.
        assert _avals(updates) == _update_avals(name, params)
        assert _avals(p) == _avals(params)
        # State structure and dtypes are stable (checkpoint-able, scan-able).
        assert jax.tree.structure(state) == jax.tree.structure(state0)
        assert _avals(state) == _avals(state0)
    assert len(traces) == 1  # evolving state, one trace (no per-step static values)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(p))
    assert _changed(p, params)

    (state1, picked, u_plain, u_chain, accumulated), caught = _compositions(opt, params)
    # optax.MultiSteps around a loss scaler is warned about (its NaN accumulator), nothing else.
    multisteps_warned = any("wrapped by optax.MultiSteps" in m for m in caught)
    assert multisteps_warned == (name in LOSS_SCALED)
    assert all("wrapped by optax.MultiSteps" in m for m in caught), caught
    assert _avals(picked) == _avals(state1) == _avals(state0)
    for a, b in zip(jax.tree.leaves(u_chain), jax.tree.leaves(u_plain)):
        # Two programs: XLA may fuse (and round) the same f32 arithmetic differently.
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=rtol(a.dtype))
    for u, p, s, s0 in accumulated.values():
        assert _avals(u) == _update_avals(name, params)
        assert _avals(s) == _avals(s0)
        assert _changed(p, params)


def test_public_surface():
    assert sorted(optim.__all__) == sorted([
        "DynamicLossScaleState", "KahanUpdatesState", "MasterWeightsState", "ScaleByAdamState",
        "StaticLossScaleState", "StochasticRoundUpdatesState", "adam", "adamw", "add_updates",
        "all_finite", "dynamic_loss_scale", "kahan_updates", "loss_scale", "master_weights",
        "multi_steps", "param_mismatches", "scale_by_adam", "scale_loss", "static_loss_scale",
        "stochastic_round_updates", "unscale_grads"])
    assert all(hasattr(optim, n) for n in optim.__all__)
    assert not hasattr(optim, "apply_updates")  # would shadow optax.apply_updates
    assert bool(optim.all_finite({"a": jnp.ones(3), "b": ()}))
    assert not bool(optim.all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])]))


def test_no_flax_in_the_optim_package():
    import pathlib

    import fmtkit.memory as mem
    import fmtkit.optim as pkg
    files = [*pathlib.Path(pkg.__file__).parent.glob("*.py"), pathlib.Path(mem.__file__)]
    lines = [ln.strip() for f in files for ln in f.read_text().splitlines()]
    assert len(files) >= 6
    assert not any(ln.startswith(("import flax", "from flax")) for ln in lines)


def test_inject_hyperparams_works_with_fmtkit_adam():
    """optax.inject_hyperparams(fmtkit.optim.adamw): every hyperparameter is an explicit
    keyword, numeric ones arrive as arrays (traced under jit), and the result equals optax's
    own adamw under the same injection (the same f32 hyperparameters and arithmetic)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32), "b": jnp.ones(3)}
    grads = {"w": jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32), "b": jnp.full(3, -0.25)}
    opt = optax.inject_hyperparams(optim.adamw)(learning_rate=1e-3)
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    state, ref_state = opt.init(params), ref.init(params)
    assert float(state.hyperparams["learning_rate"]) == np.float32(1e-3)
    update = jax.jit(opt.update)
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw is not strict-promotion clean
        for _ in range(3):
            u, state = update(grads, state, params)
            u_ref, ref_state = ref.update(grads, ref_state, params)
            for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol(np.float32))
    state.hyperparams["learning_rate"] = jnp.asarray(2e-3, jnp.float32)
    u2, _ = update(grads, state, params)
    u1, _ = update(grads, state._replace(hyperparams={**state.hyperparams,
                                                      "learning_rate": jnp.float32(1e-3)}),
                   params)
    np.testing.assert_allclose(np.asarray(u2["w"]), 2 * np.asarray(u1["w"]), rtol=1e-6)
    # array-valued hyperparameters are validated when concrete (init), not when traced
    with pytest.raises(ValueError, match="b1 must be in"):
        optax.inject_hyperparams(optim.adam)(learning_rate=1e-3, b1=1.5).init(params)
    # bf16 parameters: optax stores the hyperparameters in bf16 unless told, where b2 = 0.999
    # rounds to 1; the error says so. Then a schedule and storage options.
    bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match=r"b2 must be in.*hyperparam_dtype=jnp\.float32"):
        optax.inject_hyperparams(optim.adam)(learning_rate=1e-3).init(bf)
    sched = optax.inject_hyperparams(optim.adam, hyperparam_dtype=jnp.float32)(
        learning_rate=optax.linear_schedule(1e-3, 0.0, 10), nu_dtype="fp16", seed=3,
        rounding="stochastic")
    u, s = jax.jit(sched.update)(grads, sched.init(params), params)
    assert isinstance(s.inner_state[0].nu["w"], ScaledArray)  # fp16 nu: scaled by default
    assert int(s.inner_state[0].seed) == 3 and np.all(np.isfinite(np.asarray(u["w"])))
