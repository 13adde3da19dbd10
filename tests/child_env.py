"""The environment of a test's child Python process (a launched worker, a script with
simulated devices, an example run as a user starts it).

tests/conftest.py compiles at XLA:CPU's LLVM optimisation level 0 (its comment says why and
what that changes: no multiply-add contraction). A child that replaces the suite's XLA_FLAGS
keeps that flag through ``child_env``; without it the child's compilations, most of its
time, take about 1.3x longer (a killed-and-resumed multi-process run: 97 s -> 74 s on 2 cores).
"""

from __future__ import annotations

import os
from pathlib import Path

FAST_COMPILE = "--xla_backend_optimization_level=0"


def child_env(*flags: str, pythonpath: tuple[str | Path, ...] = (),
              drop: tuple[str, ...] = (), fast_compile: bool = True) -> dict[str, str]:
    """``os.environ`` with XLA_FLAGS replaced by ``flags`` plus ``FAST_COMPILE``, the
    ``pythonpath`` folders put first on PYTHONPATH and the variables ``drop`` removed.

    ``fast_compile=False`` for a child whose assertion is a fact of the default level's code:
    a sum over device shards bit-identical to the one-device sum holds at the default level
    and not at level 0, which vectorizes the reduction differently (one f32 ulp apart)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
    env["XLA_FLAGS"] = " ".join((*flags, FAST_COMPILE) if fast_compile else flags)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    return env
