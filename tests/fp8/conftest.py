"""Fixtures of the FP8 tests."""

import jax
import pytest

from fmtkit._lowp import gemm


@pytest.fixture
def set_fp8_switch(monkeypatch):
    """Sets a private switch of the FP8 GEMM on ``fmtkit._lowp.gemm``, the module that reads it
    (``_WIDEN_OFF_GPU``, ``_FOLD_POW2_SCALES``), or another attribute the FP8 dot reads while
    tracing (``set_fp8_switch(name, value, obj=scaling)``) for one test. JAX caches the
    custom VJP's traces across calls, so a trace made under one setting would be reused under
    the other: the caches are cleared when the switch is set and again after the test (a
    later test must not reuse this one's traces)."""
    def set_switch(name, value, obj=gemm):
        monkeypatch.setattr(obj, name, value)
        jax.clear_caches()

    yield set_switch
    monkeypatch.undo()
    jax.clear_caches()
