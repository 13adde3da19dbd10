"""Test configuration: strict numerics, so silent up-casts fail."""

import os
import sys

# XLA on CPU may keep bf16/f16 intermediates in f32 inside jit ("excess precision"), which
# hides exactly the rounding a format toolkit measures: (bf16(1) + bf16(1e-3)) -> f32 gives
# 1.0009995 under jit instead of 1.0. Must be set before JAX initializes its backend.
# Idempotent: pytest-xdist workers inherit the flag from the controlling process, which
# loaded this file too (a doubled flag breaks tests that strip it for a subprocess).
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_allow_excess_precision=false").strip()

# Compiling dominates this suite's time (tiny shapes, thousands of distinct jitted programs), and
# much of a CPU compile is LLVM optimising the generated machine code. Level 0 skips that
# (on a 2-core machine about 1.3-1.5x faster for the FP8 tests and a zoo training test).
# XLA's HLO passes (fusion, layout, algebraic simplification) run as before and LLVM does not
# reorder float operations at any level (no fast-math), but from level 1 up it
# contracts a multiply feeding an add into one FMA on CPUs that have it, and at level 0 it
# does not: a*b - c with a = 1 + 2**-12, c = 1 + 2**-11 gives 0 here and 2**-24 at the default
# level (measured, XLA:CPU, jax 0.11.2). So a result that rounds a product before adding may
# differ in its last bit from a user's default-level run; the suite's exactness claims hold at
# both (tests/fp8, tests/fp4, test_casting.py, test_scaling.py, tests/optim and
# tests/policy pass with XLA_FLAGS=--xla_backend_optimization_level=3). A level
# given in XLA_FLAGS by the caller wins.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_numerics():
    """Re-asserts strict promotion in case a test or library context changed it."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(autouse=True, scope="session")
def _drop_orbax_orphaned_reads():
    """Drops the unraisable exceptions of orbax's orphaned read coroutines, passes the rest on.

    A restore from a deliberately corrupted checkpoint (tests/studies/test_checkpoint_recovery.py)
    fails one array read; orbax (0.11) leaves the other reads of that restore as coroutines
    on an event loop it then closes, and Python finalizes them whenever the garbage collector
    runs, in whichever test comes next on that worker ("Event loop is closed", an unraisable
    exception that ``filterwarnings = error`` turns into a failure of an unrelated test;
    some come from asyncio's ``call_soon_threadsafe`` with no orbax frame left). Dropped:
    exceptions raised inside orbax's own frames, and asyncio's "Event loop is closed".
    """
    inner = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        tb = unraisable.exc_traceback
        while tb is not None:
            if f"orbax{os.sep}checkpoint" in tb.tb_frame.f_code.co_filename:
                return
            tb = tb.tb_next
        inner(unraisable)

    sys.unraisablehook = hook
    yield
    sys.unraisablehook = inner
