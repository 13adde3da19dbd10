"""studies.seeds: vmapped seeds equal separately run seeds, and are independent."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from studies import seeds as seeds_mod
from studies.seeds import init_seeds, run_seeds, stack, unstack, vmap_step

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


def test_module_example_runs():
    r = doctest.testmod(seeds_mod, verbose=False)
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
