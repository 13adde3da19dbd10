"""The watcher's side of the worker processes: the watchdog that kills a hung worker, and a
phase run as workers restarted past the items that hung or crashed.

The watcher never imports JAX (initializing a backend would take the GPU's memory from the
workers); it reads each worker's progress file (which item, since when) every ``POLL_S``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tools.gpu_check.files import read_json, record, write_json

__all__ = ["ITEM_TIMEOUT_S", "MAX_RESTARTS", "MIN_PHASE_S", "PHASE_CAP_S", "PHASE_SHARE",
           "POLL_S", "STARTUP_TIMEOUT_S", "SUMMARY_EVERY_S", "run_phase", "supervise"]

# Per-item limits (seconds): a Mosaic GPU compile takes seconds; minutes mean a hang.
ITEM_TIMEOUT_S = {"compile": 90.0, "correctness": 90.0, "bench": 100.0, "train": 300.0,
                  "tune": 100.0, "profile": 20.0}
STARTUP_TIMEOUT_S = 120.0  # a worker that has not started its first item by then is stuck
MIN_PHASE_S = 20.0  # starting a worker (imports, backend) costs ~5-10 s: not worth it below
MAX_RESTARTS = 4  # per phase; each restart skips the item that hung or crashed
# Share of the time left that a phase may use (the rest stays for the later phases). With
# the default 480 s and phases that use their budget: compile ~95 s, correctness ~95,
# bench ~115, train ~145, tune ~20, pytest the rest; phases that finish early leave their
# time to the next (on the H200 compile took ~35 s and bench ~45 s, so train, the Llama
# stack's five variants first, gets ~240 s).
PHASE_SHARE = {"compile": 0.2, "correctness": 0.25, "bench": 0.4, "train": 0.85,
               "tune": 0.8, "profile": 0.3}
# At most this long whatever the time left (twice as long in the CPU rehearsal): the
# profile is one compile and one run per shape (~5 s each) after a worker's start.
PHASE_CAP_S = {"profile": 30.0}
POLL_S = 0.5
SUMMARY_EVERY_S = 2.0


def supervise(cmd: list[str], progress_file: Path, *, item_timeout: float,
              deadline_at: float, log_file: Path, env: dict | None = None,
              startup_timeout: float = STARTUP_TIMEOUT_S,
              on_poll: Callable[[], None] | None = None) -> dict:
    """Runs ``cmd`` in a new process group; kills the group (SIGKILL) when the item named in
    ``progress_file`` has run longer than ``item_timeout``, when no item has started within
    ``startup_timeout``, or at ``deadline_at`` (epoch seconds). ``on_poll`` runs every
    ``SUMMARY_EVERY_S`` while it waits (the summary is rewritten from it).

    Returns ``{"returncode", "killed": None or the reason, "item": the item in progress
    when it ended (None if it finished them all), "seconds"}``.
    """
    progress_file.unlink(missing_ok=True)
    t0 = last_poll = time.time()
    with open(log_file, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        killed = None
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.time()
            if on_poll is not None and now - last_poll > SUMMARY_EVERY_S:
                on_poll()
                last_poll = now
            progress = read_json(progress_file, {})
            item, started = progress.get("item"), progress.get("started")
            if now > deadline_at:
                killed = "deadline"
            elif not progress and now - t0 > startup_timeout:
                killed = f"no item started within {startup_timeout:.0f} s"
            elif item is not None and started is not None and now - started > item_timeout:
                killed = f"item ran past its {item_timeout:.0f} s timeout"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    progress = read_json(progress_file, {})
    return {"returncode": proc.returncode, "killed": killed, "item": progress.get("item"),
            "seconds": round(time.time() - t0, 1)}


def run_phase(phase: str, work: Path, deadline_at: float, *, rehearsal: bool,
              excluded: set[str], env: dict, on_poll: Callable[[], None]) -> dict:
    """Runs ``phase`` in worker processes under ``supervise`` until its items are done: a
    worker that hangs or crashes on an item is restarted on the items after it (at most
    ``MAX_RESTARTS`` times), the item recorded as failed; one killed at ``deadline_at`` ends
    the phase, its item recorded as skipped. Returns the phase's results (``items``) and
    its workers' outcomes (``workers``)."""
    results_file = work / f"{phase}.json"
    write_json(results_file, {"items": {}})
    skip: list[str] = []
    runs = []
    timeout = ITEM_TIMEOUT_S[phase] * (2 if rehearsal else 1)  # CPU interpret mode is slow
    for _ in range(MAX_RESTARTS + 1):
        if deadline_at - time.time() < MIN_PHASE_S:
            runs.append({"not_started": "too little time left in the phase's budget"})
            break
        cmd = [sys.executable, "-m", "tools.gpu_check", str(work), "--worker",
               phase, "--deadline-at", repr(deadline_at), "--skip", ",".join(skip),
               "--exclude-configs", ",".join(sorted(excluded))]
        if rehearsal:
            cmd.append("--cpu-rehearsal")
        outcome = supervise(cmd, work / f"{phase}.progress.json", item_timeout=timeout,
                            deadline_at=deadline_at, log_file=work / f"{phase}.log",
                            env=env, on_poll=on_poll)
        runs.append(outcome)
        item = outcome["item"]
        if outcome["returncode"] == 0 and item is None:
            break
        if item is None:  # died before or between items: nothing to skip, do not loop
            break
        if outcome["killed"] == "deadline":  # out of time, not a verdict on the kernel
            record(results_file, item, {"skipped": "the phase's time ran out while it ran",
                                         "worker_seconds": outcome["seconds"]})
            break
        why = outcome["killed"] or f"worker died (exit status {outcome['returncode']})"
        record(results_file, item, {"ok": False, "error": f"hung or crashed: {why}",
                                     "worker_seconds": outcome["seconds"]})
        print(f"[{phase}] {item}: FAILED ({why}); restarting on the remaining items",
              flush=True)
        skip.append(item)
    (work / f"{phase}.progress.json").unlink(missing_ok=True)
    data = read_json(results_file, {"items": {}})
    data["workers"] = runs
    write_json(results_file, data)
    return data
