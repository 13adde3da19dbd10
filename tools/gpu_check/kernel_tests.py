"""The ``pytest`` phase: the compiled-mode kernel tests, in the time left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tools.gpu_check.files import REPO

__all__ = ["run_pytest"]


def run_pytest(timeout_s: float, log_file: Path) -> dict:
    """``pytest -m gpu tests/fp8/test_cublaslt.py tests/pallas_kernels`` (verbose, so each
    verdict is in the log as it happens); killed at ``timeout_s``: then the failures seen so
    far decide, and the rest counts as skipped."""
    cmd = [sys.executable, "-m", "pytest", "tests/fp8/test_cublaslt.py", "tests/pallas_kernels",
           "-m", "gpu", "-v",
           "-p", "no:cacheprovider"]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    text = log_file.read_text()
    tail = text[-3000:]
    verdicts = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.MULTILINE)
    failures = [t for t, v in verdicts if v in ("FAILED", "ERROR")]
    counts = {v: sum(1 for _, x in verdicts if x == v) for v in ("PASSED", "FAILED",
                                                                 "ERROR", "SKIPPED")}
    if rc is None:
        out = {"skipped": f"killed after {timeout_s:.0f} s (out of time)", "counts": counts,
               "failures": failures, "tail": tail}
        if failures:
            out["ok"] = False
        return out
    return {"ok": rc == 0, "returncode": rc, "counts": counts, "failures": failures,
            "tail": tail}
