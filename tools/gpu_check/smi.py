"""``nvidia-smi`` telemetry of the watcher (no JAX): clocks, power, temperature and
throttle reasons, sampled before, during (per phase) and after the check."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

__all__ = ["SMI_FIELDS", "Sampler", "gpu_telemetry"]

SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
              "power.draw", "power.limit", "temperature.gpu", "utilization.gpu",
              "clocks_throttle_reasons.active")


def gpu_telemetry() -> dict | None:
    """One ``nvidia-smi --query-gpu`` sample of the first GPU (clocks in MHz, power in W),
    or None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, f"--query-gpu={','.join(SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode or not proc.stdout.strip():
        return None
    values = [v.strip() for v in proc.stdout.splitlines()[0].split(",")]
    row: dict[str, Any] = {"time": time.time()}
    for key, v in zip(SMI_FIELDS, values):
        try:
            row[key] = float(v)
        except ValueError:
            row[key] = v
    return row


class Sampler:
    """Samples ``gpu_telemetry`` every ``period`` s in a thread, per phase."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.samples: dict[str, list[dict]] = {}
        self.phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = gpu_telemetry() is not None
        if self.available:
            self._thread.start()

    def _run(self):
        while not self._stop.wait(self.period):
            phase = self.phase
            if phase is not None:
                row = gpu_telemetry()
                if row is not None:
                    self.samples.setdefault(phase, []).append(row)

    def stop(self):
        self._stop.set()

    def summary(self) -> dict | None:
        if not self.available:
            return None

        def stats(rows, key):
            vals = [r[key] for r in rows if isinstance(r.get(key), float)]
            return ({"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
                    if vals else None)

        return {phase: {"samples": len(rows), "sm_clock_mhz": stats(rows, "clocks.sm"),
                        "power_w": stats(rows, "power.draw"),
                        "temperature_c": stats(rows, "temperature.gpu"),
                        "throttle_reasons": sorted({str(r.get("clocks_throttle_reasons.active"))
                                                    for r in rows})}
                for phase, rows in self.samples.items()}
