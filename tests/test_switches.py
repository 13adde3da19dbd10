"""The private switches: ``flipped`` sets them for a block, restores them, refuses unknown names."""

import jax
import jax.numpy as jnp
import pytest

from fmtkit import _switches
from fmtkit._switches import SWITCHES, flipped


def test_flipped_sets_and_restores():
    assert SWITCHES.trace_cache is True
    with flipped(trace_cache=False, partials_budget_bytes=7) as s:
        assert s is SWITCHES
        assert SWITCHES.trace_cache is False and SWITCHES.partials_budget_bytes == 7
    assert SWITCHES.trace_cache is True and SWITCHES.partials_budget_bytes == 32 * 2**20


def test_flipped_restores_after_an_error():
    with pytest.raises(RuntimeError), flipped(widen_off_gpu=False):
        raise RuntimeError
    assert SWITCHES.widen_off_gpu is True


def test_flipped_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"unknown switches.*no_such"):
        with flipped(no_such=True):
            pass


def test_flipped_clears_traces():
    # A function that reads a switch while tracing is traced again under the new setting.
    @jax.jit
    def f(x):
        return x + (1.0 if _switches.SWITCHES.dedup_cotangent else 2.0)

    assert float(f(jnp.float32(0))) == 1.0
    with flipped(dedup_cotangent=False):
        assert float(f(jnp.float32(0))) == 2.0
    assert float(f(jnp.float32(0))) == 1.0
