"""Interleaved host timing of several implementations (the bench, tune and train phases),
in batches sized for a GPU, on the studies' timing loop (``studies.lib.timing``)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from studies.lib.timing import time_samples

__all__ = ["BATCH_TARGET_S", "time_interleaved"]

BATCH_TARGET_S = 2e-3  # calls per timed batch: enough that one dispatch is noise


def _batch_size(fn: Callable[[], Any], sync: Callable[[Any], Any], rehearsal: bool) -> int:
    if rehearsal:
        return 1
    t0 = time.perf_counter()
    sync([fn() for _ in range(3)])
    per_call = (time.perf_counter() - t0) / 3
    return max(1, min(50, math.ceil(BATCH_TARGET_S / max(per_call, 1e-7))))


def time_interleaved(fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]],
                     rounds: int, rehearsal: bool) -> dict[str, dict]:
    """Per implementation ``(call, sync)``: after warm-up, ``rounds`` rounds in which every
    implementation runs one batch of calls in turn (``studies.lib.timing.time_samples``, so
    drifting clocks hit all alike); a batch is timed on the host from its first dispatch to
    ``sync`` (dispatch overlaps the device's work; the batch is long enough,
    ``BATCH_TARGET_S``, for one dispatch to be noise). Returns per implementation min /
    median / max seconds per call."""
    batch = {}
    for name, (fn, sync) in fns.items():
        sync(fn())
        batch[name] = _batch_size(fn, sync, rehearsal)
    samples = time_samples({name: fn for name, (fn, _) in fns.items()}, rounds,
                           syncs={name: sync for name, (_, sync) in fns.items()}, calls=batch)
    return {name: {"min_s": min(v), "median_s": statistics.median(v), "max_s": max(v),
                   "samples": len(v), "calls_per_sample": batch[name]}
            for name, v in samples.items()}
