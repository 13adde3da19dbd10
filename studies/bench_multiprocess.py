"""Benchmark: 2 processes (``jax.distributed``, gloo on 127.0.0.1) vs 1 process with 2
devices, the same global batch and partitioning, per setup (``fmtkit bench multiprocess``).

What keeping precision state global costs: in the step, the gradient is all-reduced once
(every setup pays that), and then the skip decision of dynamic loss scaling is computed from
the already-reduced gradient (no extra communication), while delayed FP8 adds one max
all-reduce per amax observation. So the overhead shows as how much more a setup with precision
state slows down going from 1 to 2 processes than a setup without any (bf16-mixed)::

    slowdown(setup) = step_ms(2 processes) / step_ms(1 process)
    overhead(setup) = slowdown(setup) / slowdown(bf16-mixed) - 1

Timing two runs of separate processes on a shared machine is noisy (about ±20% here), so
the bench also counts what the step communicates, exactly: the all-reduces of the compiled
step (from its HLO; the same partitioning for 1 process with 2 devices as for 2 processes)
and their bytes per step. The extra all-reduces of a setup over bf16-mixed are what keeping
its precision state global costs.

Prints a table and writes ``runs/bench-multiprocess/results.json``. Not a test: the timings
depend on the machine (on a loaded 2-core CPU box both processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

SETUPS = ("bf16-mixed", "fp16-dynamic", "fp8-delayed")
"""No precision state; loss scale + skip decision; delayed-FP8 amax histories."""


_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def all_reduces(hlo_text: str) -> tuple[int, int]:
    """(count, bytes) of the all-reduce instructions in compiled HLO text (a combined
    all-reduce of a tuple counts once, with all its operands' bytes)."""
    count = nbytes = 0
    for line in hlo_text.splitlines():
        m = _ALL_REDUCE.search(line)
        if not m:
            continue
        count += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n * bits // 8
    return count, nbytes


def _worker(setup: str, steps: int, out: str) -> None:
    from studies.training import distributed

    distributed.initialize_from_env()
    from studies.train import TrainConfig, batch_at, load_data, make_train_step, train
    from studies.training.mesh import put_batch

    # The tiny LM, batch 8 of 64 bytes (the default TrainConfig sizes): small enough for a
    # shared CPU, big enough that a step is not only dispatch overhead.
    cfg = TrainConfig(steps=steps, batch=8, seq_len=64, warmup=1, corpus_bytes=1 << 16,
                      data_parallel=2)
    res = train(setup, cfg)
    init_fn, step_fn = make_train_step(setup, cfg)
    tokens = put_batch(batch_at(load_data(cfg), cfg, 0), cfg.data_parallel)
    count, nbytes = all_reduces(step_fn.lower(init_fn(), tokens).compile().as_text())
    if distributed.is_primary():
        Path(out).write_text(json.dumps({"step_ms": res.step_ms,
                                         "compile_seconds": res.compile_seconds,
                                         "all_reduces": count, "all_reduce_bytes": nbytes}))


def _run(setup: str, steps: int, processes: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "r.json")
        worker = [sys.executable, "-m", "studies.bench_multiprocess", "--worker", setup,
                  str(steps), out]
        if processes == 1:
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
            cmd = worker
        else:
            cmd = [sys.executable, "-m", "studies.launch", "--num-processes", "2",
                   "--timeout", "600", "--", *worker]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=660)
        if r.returncode:
            raise RuntimeError(f"{setup} on {processes} process(es) failed:\n"
                               f"{r.stderr[-2000:]}")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        _worker(argv[1], int(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(prog="fmtkit bench multiprocess", description=__doc__)
    p.add_argument("--steps", type=int, default=12, help="steps per run (median of 2..)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from studies._bench import write_results

    rows = {}
    for s in args.setups:
        one = _run(s, args.steps, 1)
        two = _run(s, args.steps, 2)
        rows[s] = {"one_process_ms": one["step_ms"], "two_processes_ms": two["step_ms"],
                   "slowdown": two["step_ms"] / one["step_ms"],
                   "all_reduces": two["all_reduces"],
                   "all_reduce_bytes": two["all_reduce_bytes"]}
    base = rows.get("bf16-mixed", {}).get("slowdown")
    print(f"{'setup':14} {'1 proc ms':>10} {'2 procs ms':>11} {'2p/1p':>7} {'overhead':>9} "
          f"{'all-reduces':>12} {'bytes/step':>11}")
    for s, r in rows.items():
        r["overhead"] = None if base is None else r["slowdown"] / base - 1
        ov = "-" if r["overhead"] is None else f"{100 * r['overhead']:+.1f}%"
        print(f"{s:14} {r['one_process_ms']:10.1f} {r['two_processes_ms']:11.1f} "
              f"{r['slowdown']:7.2f} {ov:>9} {r['all_reduces']:12d} "
              f"{r['all_reduce_bytes']:11d}")
    print("overhead: (2p/1p of the setup) / (2p/1p of bf16-mixed) - 1; all-reduces and bytes "
          "per step from the compiled step's HLO (2 processes).")
    print(f"wrote {write_results('multiprocess', {'steps': args.steps, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
