"""Interleaved wall-time measurement, shared by the benchmarks and the GPU check.

Several implementations compared in one run are timed in rounds, one sample of each per
round, so that a drifting clock (thermal throttling, a neighbour's load) hits all of them
alike and the ratio measured in one run is what counts. A sample is ``calls`` calls issued
back to back and synchronised once (``jax.block_until_ready`` unless the implementation
brings its own), in seconds per call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["time_fn", "time_interleaved", "time_samples"]


def time_samples(fns: Mapping[str, Callable[[], Any]], repeats: int, *,
                 alternate: bool = False,
                 syncs: Mapping[str, Callable[[Any], Any]] | None = None,
                 calls: Mapping[str, int] | None = None) -> dict[str, list[float]]:
    """Wall-time samples (seconds per call) of several zero-argument callables, one sample of
    each per round, ``repeats`` rounds.

    Args:
      fns: name -> the call to time.
      repeats: the number of rounds.
      alternate: reverse the order every other round, so that the ratio of neighbouring
        samples cancels the machine's drift.
      syncs: name -> what waits for that call's list of outputs (default
        ``jax.block_until_ready``).
      calls: name -> calls per sample (default 1), timed from the first dispatch to the sync.
    """
    syncs = syncs or {}
    calls = calls or {}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats):
        for k in (list(fns)[::-1] if alternate and i % 2 else list(fns)):
            n = calls.get(k, 1)
            sync = syncs.get(k, jax.block_until_ready)
            t0 = time.perf_counter()
            sync([fns[k]() for _ in range(n)])
            samples[k].append((time.perf_counter() - t0) / n)
    return samples


def time_interleaved(fns: Mapping[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3
                     ) -> dict[str, float]:
    """Median seconds per call of several zero-argument callables after ``warmup`` calls of
    each, timed in alternation (``time_samples``)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    return {k: statistics.median(v) for k, v in time_samples(fns, repeats).items()}


def time_fn(fn: Callable[..., Any], *args: Any, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time in seconds of ``fn(*args)`` after warm-up, blocking on the result."""
    return time_interleaved({"fn": lambda: fn(*args)}, repeats, warmup)["fn"]
