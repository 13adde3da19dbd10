"""Telemetry statistics against hand-computed values and a float64 NumPy reference."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fmtkit import BlockScaling, DelayedScaling, qdq
from fmtkit.telemetry import cast_stats, compare, quantize_stats, tree_stats


def test_cast_stats_fp16_underflow_overflow():
    x = jnp.array([1e-8, 1.0, 7e4, 0.0], jnp.float32)
    s = cast_stats(x, "fp16")
    # of the 3 nonzero inputs, 1e-8 flushes
    assert float(s.underflow_share) == pytest.approx(1 / 3)
    assert float(s.overflow_share) == pytest.approx(1 / 4)  # 7e4 > 65504 of 4 finite inputs
    assert float(s.nonfinite_share) == pytest.approx(1 / 4)
    assert float(s.amax) == 7e4


def test_cast_stats_saturate_counts_overflow_without_nonfinite():
    s = cast_stats(jnp.array([1000.0, 1.0], jnp.float32), "e4m3", overflow="saturate")
    assert float(s.overflow_share) == 0.5
    assert float(s.nonfinite_share) == 0.0


def test_sqnr_and_relative_error_by_hand():
    x = jnp.array([1.0, 2.0], jnp.float32)
    y = jnp.array([1.0, 2.5], jnp.float32)
    s = compare(x, y)
    # signal 1 + 4 = 5, noise 0.25 -> 10 log10(20); rel = 0.5 / sqrt(5)
    assert float(s.sqnr_db) == pytest.approx(10 * np.log10(20.0), rel=1e-6)
    assert float(s.rel_error) == pytest.approx(0.5 / np.sqrt(5.0), rel=1e-6)
    assert float(compare(x, x).sqnr_db) == np.inf


def test_quantize_stats_matches_float64_reference():
    x = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)
    recipe = BlockScaling((1, 128))
    s = jax.jit(lambda v: quantize_stats(v, "e4m3", recipe))(x)
    xn = np.asarray(x, np.float64)
    yn = np.asarray(qdq(x, "e4m3", recipe), np.float64)
    sqnr = 10 * np.log10(np.sum(xn**2) / np.sum((xn - yn) ** 2))
    assert float(s.sqnr_db) == pytest.approx(sqnr, rel=1e-4)  # f32 vs f64 sums
    assert float(s.overflow_share) == 0.0  # current scaling never clips


def test_quantize_stats_delayed_counts_clipped_values():
    recipe = DelayedScaling(history=4)
    state = recipe.update(recipe.init(), jnp.float32(1.0))  # history amax 1.0
    x = jnp.array([0.5, 2.0, -3.0, 1.0], jnp.float32)
    s = quantize_stats(x, "e4m3", recipe, state=state)
    assert float(s.overflow_share) == 0.5  # 2 and -3 exceed the history's amax and are clipped


def test_tree_stats_keys_by_path():
    tree = {"w": jnp.full((3,), 1e-8, jnp.float32), "b": {"c": jnp.ones((2,), jnp.float32)},
            "step": jnp.zeros((), jnp.int32)}
    stats = tree_stats(tree, lambda g: cast_stats(g, "fp16"))
    assert set(stats) == {"w", "b/c"}  # integer leaves are skipped
    assert float(stats["w"].underflow_share) == 1.0
    assert float(stats["b/c"].underflow_share) == 0.0


def test_bad_input():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        cast_stats(jnp.arange(3), "fp16")
    with pytest.raises(ValueError, match="same shape"):
        compare(jnp.ones(3), jnp.ones(4))


@pytest.mark.slow
def test_earlier_field_names_warn_once_and_read_the_renamed_statistic(monkeypatch):
    from fmtkit import telemetry

    monkeypatch.setattr(telemetry, "_WARNED", set())
    s = cast_stats(jnp.array([1e-8, 1.0, 7e4, jnp.inf], jnp.float32), "fp16")
    for old, new in (("underflow", "underflow_share"), ("overflow", "overflow_share"),
                     ("nonfinite", "nonfinite_share")):
        with pytest.warns(DeprecationWarning, match=f"NumericsStats.{old} is deprecated: use "
                          f"NumericsStats.{new}"):
            assert getattr(s, old) is getattr(s, new)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(s, old) is getattr(s, new)  # once: no second warning
