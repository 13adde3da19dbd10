"""The delayed-scaling state: one amax history per operand role, its bootstrap and update rule."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_testlib import DN, data

from fmtkit import fp8
from fmtkit.scaling import DelayedScalingState


def test_delayed_bootstrap_history_and_accumulation():
    recipe = fp8.get_recipe("delayed")
    x, w, dy = data(128, 256, 128)
    dg = fp8.dot_general_fn(recipe)

    def loss(x, w, state):
        return jnp.sum(dg(x, w, DN, fp8_state=state) * dy)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    state = fp8.init_state(recipe)
    # First step: bootstrapped from the current amax, so it equals "current" scaling exactly.
    y_delayed = dg(x, w, DN, fp8_state=state)
    y_current = fp8.dot_general_fn("current")(x, w, DN)
    np.testing.assert_array_equal(np.asarray(y_delayed), np.asarray(y_current))
    _, _, obs = grad(x, w, state)
    expected = [np.abs(np.asarray(x)).max(), np.abs(np.asarray(w)).max(),
                np.abs(np.asarray(dy)).max()]
    np.testing.assert_allclose(np.asarray(obs.amax_history[:, 0]), expected, rtol=0)
    state = fp8.update_state(state, obs)
    assert float(state.amax_history[0, 1]) == 0.0  # rolled: one step recorded
    # Four micro-batches of growing size: the recorded amax is the max over them.
    micro = [(x * s, w) for s in (0.5, 3.0, 1.0, 2.0)]
    acc = None
    for xm, wm in micro:
        o = grad(xm, wm, state)[2]
        acc = o if acc is None else fp8.combine_observations(acc, o)
    state = fp8.update_state(state, acc)
    assert float(state.amax_history[0, 1]) == expected[0]  # previous step rolled back
    np.testing.assert_allclose(float(state.amax_history[0, 0]), 3.0 * expected[0], rtol=1e-6)
    np.testing.assert_allclose(float(state.amax_history[0, 1]), expected[0], rtol=1e-6)
    # The scale now follows the history (max of 3x and 1x amax), not the current tensor.
    hist_scale = 3.0 * expected[0] * np.float32(1 / 448)
    y = dg(x, w, DN, fp8_state=state)
    xq = np.clip(np.asarray(x) / np.float32(hist_scale), -448, 448).astype(
        ml_dtypes.float8_e4m3fn)
    assert np.asarray(xq).astype(np.float32).std() < 448  # sanity: values in range
    assert not np.array_equal(np.asarray(y), np.asarray(y_current))


def test_update_state_ignores_non_finite_observations():
    state = fp8.init_state(dataclasses.replace(fp8.RECIPES["delayed"], history=4))
    obs = DelayedScalingState(jnp.zeros((3, 4)).at[:, 0].set(jnp.array([1.0, 2.0, 3.0])))
    state = fp8.update_state(state, obs)
    bad = DelayedScalingState(jnp.zeros((3, 4)).at[:, 0].set(jnp.array([1.0, 2.0, jnp.inf])))
    same = fp8.update_state(state, bad)  # an overflowing step (skipped by loss scaling)
    np.testing.assert_array_equal(np.asarray(same.amax_history), np.asarray(state.amax_history))
    assert float(state.amax_history[2, 0]) == 3.0


def test_one_state_type_for_every_delayed_recipe():
    from fmtkit.scaling import DelayedScaling

    st = fp8.init_state()
    assert type(st) is DelayedScalingState
    assert st.amax_history.shape == (3, 1024) and st.count is None
    # The same rule records into both: a non-finite amax is skipped by each.
    d = DelayedScaling(history=4)
    s1 = d.update(d.init(), jnp.float32(jnp.inf))
    np.testing.assert_array_equal(np.asarray(s1.amax_history), np.zeros(4))
    assert int(s1.count) == 0


def test_delayed_bootstrap_is_per_row_of_the_history():
    """x's row is empty (bootstraps from the current amax); w's row holds 2.0 (used)."""
    recipe = dataclasses.replace(fp8.RECIPES["delayed"], history=4)
    x, w, _ = data(64, 128, 64, seed=9)
    hist = jnp.zeros((3, 4)).at[1, 2].set(2.0)
    y = fp8.dot_general_fn(recipe)(x, w, DN, fp8_state=DelayedScalingState(hist))
    e4m3 = ml_dtypes.float8_e4m3fn

    def q(t, amax):
        scale = np.float32(amax) * np.float32(1 / 448)
        v = np.clip(np.asarray(t, np.float32) * (np.float32(1) / scale), -448, 448)
        return v.astype(e4m3).astype(np.float64) * np.float64(scale)

    ref = q(x, np.abs(np.asarray(x)).max()) @ q(w, 2.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


def test_update_state_on_a_stack_of_layers():
    """[L, 3, H] histories (a scanned stack): rolled along H, skipped per layer."""
    h = 4
    hist = np.zeros((3, 3, h), np.float32)
    hist[:, :, 0] = 1.0
    obs = np.zeros((3, 3, h), np.float32)
    obs[:, :, 0] = [[2, 3, 4], [5, np.inf, 6], [7, 8, 9]]
    tree = {"blocks": DelayedScalingState(jnp.asarray(hist)), "head": jnp.asarray(hist[0])}
    got = fp8.update_state(tree, {"blocks": DelayedScalingState(jnp.asarray(obs)),
                                  "head": jnp.asarray(obs[2])})
    want = hist.copy()
    for layer in (0, 2):  # layer 1 saw an inf: unchanged
        want[layer, :, 1:] = hist[layer, :, :-1]
        want[layer, :, 0] = obs[layer, :, 0]
    np.testing.assert_array_equal(np.asarray(got["blocks"].amax_history), want)
    np.testing.assert_array_equal(np.asarray(got["head"]), want[2])
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, history\]"):
        fp8.update_state(jnp.zeros((4, 8)), jnp.zeros((4, 8)))


def test_update_state_with_a_wrong_tree_says_what_it_expects():
    state = fp8.init_state(dataclasses.replace(fp8.RECIPES["delayed"], history=4))
    for wrong in (state.amax_history, {"dot": state}, None):
        with pytest.raises(ValueError, match="same structure as state, the gradient of the loss"):
            fp8.update_state(state, wrong)
