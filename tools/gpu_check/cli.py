"""The command line, and the watcher's run over the phases: workers per phase, the
nvidia-smi sampler, the summary rewritten as items finish, the log tarball after each phase.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import tools.gpu_check as gpu_check
from tools.gpu_check.files import REPO, read_json, tar_logs, write_json
from tools.gpu_check.kernel_tests import run_pytest
from tools.gpu_check.profile import copy_traces
from tools.gpu_check.report import empty_report, fill, summary_lines
from tools.gpu_check.smi import Sampler, gpu_telemetry
from tools.gpu_check.watcher import MIN_PHASE_S, PHASE_CAP_S, PHASE_SHARE, run_phase
from tools.gpu_check.worker import PHASES, run_worker

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python3 -m tools.gpu_check``: the watcher's run over the phases (module docstring of
    ``tools.gpu_check``), or, with the hidden ``--worker PHASE``, one worker. Returns the exit
    status."""
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu_check",
                                description=gpu_check.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default=None,
                   help="folder for gpu_check.json and gpu_check_logs.tar.gz "
                        "(default runs/gpu-check)")
    p.add_argument("--out-dir", dest="out_dir_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=480.0,
                   help="seconds after which every worker is killed and the run ends "
                        "(default 480: fits a 10-minute device window with room to spare)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--cpu-rehearsal", action="store_true",
                   help="run every phase on CPU in GPU-interpret mode at tiny shapes "
                        "(no pytest): catches script errors before GPU time")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help=argparse.SUPPRESS)
    p.add_argument("--exclude-configs", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir or args.out_dir_opt or "runs/gpu-check")
    if args.worker:  # out_dir is the watcher's work folder
        return run_worker(args.worker, out_dir, args.deadline_at or time.time() + args.deadline,
                          set(filter(None, args.skip.split(","))), args.cpu_rehearsal,
                          set(filter(None, args.exclude_configs.split(","))))
    if args.deadline <= 0:
        p.error(f"--deadline must be positive, got {args.deadline}")
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    bad = [s for s in phases if s not in PHASES]
    if bad:
        p.error(f"--phases: unknown {bad}; allowed: {', '.join(PHASES)}")
    if args.cpu_rehearsal and "pytest" in phases:
        phases.remove("pytest")
    out_dir.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    deadline_at = t_start + args.deadline
    report_file, tar_file = out_dir / "gpu_check.json", out_dir / "gpu_check_logs.tar.gz"
    command = " ".join(["python3 -m tools.gpu_check",
                        *(argv if argv is not None else sys.argv[1:])])
    report = empty_report(command, args.cpu_rehearsal, args.deadline)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    sampler = Sampler()
    before = gpu_telemetry()
    report["telemetry"]["before"] = before
    report["driver"] = before.get("driver_version") if before else None

    def save():
        report["elapsed_s"] = round(time.time() - t_start, 1)
        report["telemetry"]["during"] = sampler.summary()
        write_json(report_file, report)

    def refresh(phase):
        def poll():
            items = read_json(work / f"{phase}.json", {}).get("items", {})
            report["phases"][phase] = {"ok": None, "items": items}
            fill(report, phase, items, work)
            save()
        return poll

    env = dict(os.environ)  # workers import this checkout, wherever we were started from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Leave GPU memory to torch._scaled_mm (bench) and to the study's own process (train).
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    excluded: set[str] = set()
    failed = False
    save()
    try:
        for phase in phases:
            sampler.phase = phase
            if phase == "pytest":
                left = deadline_at - time.time()
                result = (run_pytest(left - 5.0, work / "pytest.log") if left > MIN_PHASE_S
                          else {"skipped": "too little time left before the global deadline"})
                report["pytest"] = result
                report["phases"]["pytest"] = {"ok": result.get("ok")}
                failed = failed or not result.get("ok", True)
                save()
                continue
            phase_env = dict(env)
            if phase == "compile":  # ptxas's register/spill report of every kernel compiled
                phase_env.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1",
                                 MOSAIC_GPU_DUMP_SASS="1")
            if phase == "bench":  # XLA's GEMM rewriter says which FP8 dots it rewrote, or why not
                phase_env.update(TF_CPP_VMODULE="gemm_rewriter=1", TF_CPP_MIN_LOG_LEVEL="0")
            left = deadline_at - time.time()
            phase_deadline = time.time() + min(
                max(MIN_PHASE_S, PHASE_SHARE[phase] * left),
                PHASE_CAP_S.get(phase, left) * (2 if args.cpu_rehearsal else 1))
            data = run_phase(phase, work, min(deadline_at, phase_deadline),
                              rehearsal=args.cpu_rehearsal, excluded=excluded, env=phase_env,
                              on_poll=refresh(phase))
            items = data.get("items", {})
            phase_ok = all(r.get("ok", True) for r in items.values())
            report["phases"][phase] = {"ok": phase_ok, **data}
            fill(report, phase, items, work)
            if phase == "profile":  # the raw traces, beside the report
                report["profile_traces"] = copy_traces(work, out_dir)
            failed = failed or not phase_ok
            print(f"[{phase}] {'ok' if phase_ok else 'FAILED'}: "
                  f"{sum(bool(r.get('ok')) for r in items.values())}/{len(items)} items ok, "
                  f"{sum('skipped' in r for r in items.values())} skipped", flush=True)
            if phase == "compile":
                env_item = items.get("env") or {}
                if not env_item.get("hopper") and not args.cpu_rehearsal:
                    report["status"] = ("no Hopper GPU: nothing checked" if env_item
                                        else "the compile worker did not report the device")
                    print(f"gpu_check: {report['status']} ({env_item.get('device')}).")
                    return 0 if env_item else 1
                for r in items.values():
                    if "config" in r and r.get("ok") is False:
                        excluded.add(r["config"])
                for name, r in items.items():  # hung or crashed: named by the item
                    m = re.match(r"^kernel-(bm\d+_bn\d+_split[mn]_s\d+)-", name)
                    if m and r.get("ok") is False:
                        excluded.add(m.group(1))
                report["excluded_configs"] = sorted(excluded)
            save()
            tar_logs(work, tar_file)
        skipped = any("skipped" in r for ph in report["phases"].values()
                      for r in (ph.get("items") or {}).values()) or any(
            "skipped" in (ph or {}) for ph in report["phases"].values())
        # "incomplete": nothing failed, but the time ran out before every item ran.
        report["status"] = "failed" if failed else "incomplete" if skipped else "passed"
    finally:
        sampler.phase = None
        sampler.stop()
        report["telemetry"]["after"] = gpu_telemetry()
        save()
        tar_logs(work, tar_file)
        shutil.rmtree(work, ignore_errors=True)
    for line in summary_lines(report):
        print(line)
    print(f"gpu_check {report['status']}; wrote {report_file} and {tar_file}")
    return 1 if failed else 0
