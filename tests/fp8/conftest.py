"""Fixtures of the FP8 tests."""

import contextlib

import jax
import pytest

from fmtkit._switches import flipped


@pytest.fixture
def set_fp8_switch(monkeypatch):
    """Sets a private switch of the FP8 GEMM (a field of ``fmtkit._switches.Switches``:
    ``widen_off_gpu``, ``fold_pow2_scales``, ``scan_block_dots``, ``partials_budget_bytes``)
    for the rest of one test through ``flipped``, or another attribute the FP8 dot reads while
    tracing (``set_fp8_switch(name, value, obj=scaling)``). JAX caches the custom VJP's traces
    across calls, so a trace made under one setting would be reused under the other: the
    caches are cleared when the switch is set and again after the test (a later test must not
    reuse this one's traces)."""
    with contextlib.ExitStack() as flips:
        def set_switch(name, value, obj=None):
            if obj is None:
                flips.enter_context(flipped(**{name: value}))
            else:
                monkeypatch.setattr(obj, name, value)
                jax.clear_caches()

        yield set_switch
        monkeypatch.undo()
    jax.clear_caches()
