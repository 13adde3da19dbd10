"""Shared timing helpers for the side-by-side benchmarks (``fmtkit bench NAME``)."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax


def time_fn(fn: Callable[..., Any], *args: Any, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time in seconds of ``fn(*args)`` after warm-up, blocking on the result."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_samples(fns: dict[str, Callable[[], Any]], repeats: int, *, alternate: bool = False
                 ) -> dict[str, list[float]]:
    """Wall-time samples (s) of several zero-argument callables, one of each per repeat, in
    alternation (``alternate``: the order reversed every other repeat, so that the ratio of
    neighbouring samples cancels the machine's drift)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats):
        for k in (list(fns)[::-1] if alternate and i % 2 else list(fns)):
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k]())
            samples[k].append(time.perf_counter() - t0)
    return samples


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3
                     ) -> dict[str, float]:
    """Median times of several zero-argument callables, run in alternation so that machine
    noise hits all of them alike (the ratio measured in one run is what counts)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    return {k: statistics.median(v) for k, v in time_samples(fns, repeats).items()}


def environment() -> dict[str, Any]:
    """Versions and device, recorded with every benchmark result."""
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name: str, results: dict[str, Any], out_dir: str | None = None) -> Path:
    """Writes ``results`` (plus the environment) to runs/bench-NAME/results.json."""
    path = Path(out_dir or Path("runs") / f"bench-{name}")
    path.mkdir(parents=True, exist_ok=True)
    file = path / "results.json"
    file.write_text(json.dumps({"env": environment(), **results}, indent=2))
    return file
