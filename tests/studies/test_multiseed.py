"""studies.training.multiseed: the seeds axis (vmapped seeds equal separately run seeds, and
are independent), and training with it: vmapped seeds equal separate runs, independent and
reproducible; resume is bit-identical; the regimes do what they claim inside training."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from studies_testlib import Interrupted, stop_after

from fmtkit import optim
from studies import training as T
from studies.lib.models import TransformerConfig
from studies.training import multiseed as M
from studies.training.multiseed import init_seeds, run_seeds, stack, unstack, vmap_step

# The seeds axis, on a generic step (a linear regression under Adam) ---------------------------

D, B = 8, 16
W_TRUE = np.linspace(-1.0, 1.0, D).astype(np.float32)
OPT = optax.adam(0.05)


def init_fn(seed):
    """Initial parameters from the seed (as a trainer does with PRNGKey(cfg.seed))."""
    w = jax.random.normal(jax.random.PRNGKey(seed), (D,), jnp.float32)
    return {"w": w, "opt": OPT.init(w), "step": jnp.zeros([], jnp.int32)}


def batch_fn(seed, step):
    """Each seed's own data order (as the trainer's batch_at: rng([seed, step]))."""
    rng = np.random.default_rng([seed, step])
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = x @ W_TRUE + 0.1 * rng.normal(size=B).astype(np.float32)
    return {"x": x, "y": y}


TRACES = []


def step_fn(state, batch):
    TRACES.append(1)

    def loss_fn(w):
        return jnp.mean(jnp.square(batch["x"] @ w - batch["y"]))

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and f32
        upd, opt = OPT.update(g, state["opt"], state["w"])
    w = optax.apply_updates(state["w"], upd)
    # A data-dependent branch: under vmap it becomes a select, per seed.
    w = jax.lax.cond(loss > 1e6, lambda v: jnp.zeros_like(v), lambda v: v, w)
    return {"w": w, "opt": opt, "step": state["step"] + 1}, {"loss": loss}


def test_run_seeds_example_runs():
    r = doctest.testmod(M, verbose=False)
    assert r.attempted > 0 and r.failed == 0


def test_vmapped_seeds_equal_separate_runs():
    seeds, steps = [0, 1, 5], 12
    TRACES.clear()
    fresh = lambda st, b: step_fn(st, b)  # noqa: E731  (a new function: not compiled yet)
    states, hist = run_seeds(init_fn, fresh, batch_fn, seeds, steps)
    assert len(TRACES) == 1  # one compile serves every seed and every step
    run_seeds(init_fn, fresh, batch_fn, seeds, 2, states=states, start=steps)
    assert len(TRACES) == 1  # and a resumed run reuses it
    assert hist["loss"].shape == (3, steps) and hist["loss"].dtype == np.float64
    one = jax.jit(step_fn)
    for i, s in enumerate(seeds):
        st = init_fn(s)
        losses = []
        for t in range(steps):
            st, m = one(st, jax.tree.map(jnp.asarray, batch_fn(s, t)))
            losses.append(float(m["loss"]))
        # Batched and unbatched kernels may reduce in different orders: f32 rounding only.
        np.testing.assert_allclose(hist["loss"][i], losses, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(states["w"][i]), np.asarray(st["w"]),
                                   rtol=1e-5, atol=1e-6)
        assert int(states["step"][i]) == steps


def test_seeds_are_independent_and_reproducible():
    seeds = [0, 1, 2]
    s0 = init_seeds(init_fn, seeds)
    w0 = np.asarray(s0["w"])
    # Different initial parameters per seed...
    assert not np.array_equal(w0[0], w0[1]) and not np.array_equal(w0[1], w0[2])
    # ... and different batches (each seed its own rng([seed, step]) stream).
    assert not np.array_equal(batch_fn(0, 3)["x"], batch_fn(1, 3)["x"])
    _, h1 = run_seeds(init_fn, step_fn, batch_fn, seeds, 6)
    _, h2 = run_seeds(init_fn, step_fn, batch_fn, seeds, 6)
    np.testing.assert_array_equal(h1["loss"], h2["loss"])  # reproducible
    assert len({tuple(r) for r in h1["loss"].tolist()}) == 3  # no two seeds alike
    # Seed i's run does not depend on which other seeds run beside it.
    _, alone = run_seeds(init_fn, step_fn, batch_fn, [2], 6)
    np.testing.assert_allclose(alone["loss"][0], h1["loss"][2], rtol=1e-5)


def test_resume_continues_the_same_runs():
    seeds = [3, 4]
    full, hf = run_seeds(init_fn, step_fn, batch_fn, seeds, 8)
    half, _ = run_seeds(init_fn, step_fn, batch_fn, seeds, 4)
    rest, hr = run_seeds(init_fn, step_fn, batch_fn, seeds, 4, states=half, start=4)
    np.testing.assert_array_equal(hr["loss"], hf["loss"][:, 4:])
    np.testing.assert_array_equal(np.asarray(rest["w"]), np.asarray(full["w"]))


def test_stack_unstack_roundtrip():
    trees = [init_fn(s) for s in (0, 1)]
    back = unstack(stack(trees))
    for a, b in zip(trees, back):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    st, m = vmap_step(step_fn)(stack(trees), stack([jax.tree.map(jnp.asarray, batch_fn(s, 0))
                                                    for s in (0, 1)]))
    assert m["loss"].shape == (2,) and st["w"].shape == (2, D)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one seed"):
        init_seeds(init_fn, [])
    with pytest.raises(ValueError, match="distinct"):
        init_seeds(init_fn, [1, 1])
    with pytest.raises(ValueError, match="ints >= 0"):
        init_seeds(init_fn, [-1])
    with pytest.raises(ValueError, match="steps must be"):
        run_seeds(init_fn, step_fn, batch_fn, [0], -1)


# Training seeds together (the micro transformer) ----------------------------------------------

MICRO = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)


def micro(**kw):
    base = dict(model=MICRO, batch=4, seq_len=16, steps=6, warmup=2, corpus_bytes=4096,
                seeds=2)
    return T.TrainConfig(**{**base, **kw})


@pytest.mark.slow  # two vmapped runs and two single-seed runs of the micro model
def test_vmapped_seeds_match_separate_runs_including_stochastic_rounding():
    cfg = micro(seed=3)
    data = T.load_data(cfg)
    res = M.train_seeds("pure-bf16-sr", cfg, data=data)
    assert res.seeds == (3, 4)
    for j, s in enumerate(cfg.seed_list):
        one = T.train("pure-bf16-sr", cfg.with_seed(s), data=data)
        # Same arithmetic up to the batched kernels' reduction order (M.vmap_step): with
        # the SR seed in the optimizer state each seed follows its own rounding stream.
        np.testing.assert_allclose(res.histories[j]["loss"], one.history["loss"],
                                   rtol=2e-3, atol=0)
    states = M.unstack(res.state)
    # The stochastic-rounding seed is part of each seed's state, not a constant of the step.
    sr = [x for st in states for x in jax.tree.leaves(
        st.opt_state, is_leaf=lambda x: isinstance(x, optim.StochasticRoundUpdatesState))
        if isinstance(x, optim.StochasticRoundUpdatesState)]
    assert [int(x.seed) for x in sr] == [3, 4]
    # Independent: different initial parameters (seed 3 vs 4) and different batches.
    l0, l1 = res.histories[0]["loss"], res.histories[1]["loss"]
    assert l0[0] != l1[0]
    p0 = [np.asarray(x, np.float32) for x in jax.tree.leaves(states[0].params)]
    p1 = [np.asarray(x, np.float32) for x in jax.tree.leaves(states[1].params)]
    assert any(not np.array_equal(a, b) for a, b in zip(p0, p1))
    # Reproducible: the same call gives the same numbers bit for bit.
    again = M.train_seeds("pure-bf16-sr", cfg, data=data)
    for j in range(2):
        np.testing.assert_array_equal(again.histories[j]["loss"], res.histories[j]["loss"])




@pytest.mark.slow  # three vmapped runs with checkpoints
def test_multiseed_resume_is_bit_identical(tmp_path):
    cfg = micro(checkpoint_every=3)
    data = T.load_data(cfg)
    # With the noise-curve telemetry's snapshots and gradients (step 0 kept also on resume).
    kept = dict(snapshot_steps=(0, 3, 6), grad_batch=T.batch_at(data, cfg, cfg.steps))
    full = M.train_seeds("fp16-dynamic", cfg, data=data, **kept)
    with pytest.raises(Interrupted):
        M.train_seeds("fp16-dynamic", cfg, stop_after(3), run_dir=tmp_path, data=data,
                      **kept)
    resumed = M.train_seeds("fp16-dynamic", cfg, run_dir=tmp_path, resume=True, data=data,
                            **kept)
    assert resumed.resumed_from == 3
    for got, want in ((resumed.snapshots, full.snapshots),
                      (resumed.snapshot_grads, full.snapshot_grads)):
        assert sorted(got) == sorted(want) == [0, 3, 6]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for j in range(2):
        for k in T.METRIC_KEYS:
            np.testing.assert_array_equal(resumed.histories[j][k], full.histories[j][k])


@pytest.mark.slow  # two compiles of the micro step
def test_tokens_per_update_scales_the_gradient_by_micro_over_global_tokens():
    base = micro(seeds=1)
    data = T.load_data(base)
    tokens = T.batch_at(data, base, 0)
    norms = {}
    for regime in ("none", "tokens-per-update"):
        cfg = micro(seeds=1, regime=regime)
        init_fn, step_fn = T.make_train_step("fp32", cfg)
        _, m = step_fn(init_fn(), tokens)
        norms[regime] = float(m["grad_norm"])
    # 4 sequences x 15 predicted bytes = 60 tokens of a 2^22-token update (by hand).
    assert norms["tokens-per-update"] / norms["none"] == pytest.approx(60 / 2**22, rel=1e-4)


def test_outlier_features_regime_puts_one_channel_at_1e4_in_the_model():
    cfg = micro(regime="outlier-features").model_config()
    scale = np.asarray(cfg.outlier_scale)
    assert scale.shape == (32,)
    assert np.sum(scale == 1e4) == 1 and np.sum(scale == 1.0) == 31
    assert micro().model_config().outlier_scale is None


@pytest.mark.slow  # reads the standard library, compiles the micro step and its evaluation
def test_stdlib_data_reports_a_heldout_loss_per_seed():
    cfg = micro(data="stdlib", steps=3, heldout_windows=4)
    res = M.train_seeds("fp32", cfg)
    assert res.heldout_loss is not None and len(res.heldout_loss) == 2
    # A byte-level model after 3 steps: below a uniform guess over 256 bytes (ln 256 plus a
    # margin for the untrained logits) and above 0; seeds start apart, so they differ.
    for h in res.heldout_loss:
        assert 0.0 < h < np.log(256) + 1.0
    assert res.heldout_loss[0] != res.heldout_loss[1]
    assert M.train_seeds("fp32", micro(steps=1, seeds=1)).heldout_loss is None
