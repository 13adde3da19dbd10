"""Benchmark: what keeping precision state global costs, 2 processes (``jax.distributed``,
gloo on 127.0.0.1) vs 1 process with 2 devices, the same global batch and partitioning
(``fmtkit bench multiprocess``).

Each setup with precision state runs side by side, steps interleaved in one run, with its
*twin*: the same step without that state::

    fp16-dynamic   twin fp16: the loss scale fixed (no skip decision, no scale update)
    fp8-delayed    twin: the same step with the amax histories frozen after the first step
                   (no amax observation leaves the step)

    overhead(P processes) = step_ms(setup) / step_ms(twin) - 1      (measured in one run)
    cost of global state  = overhead(2 processes) - overhead(1 process)

The overhead in 1 process is the state's arithmetic; what 2 processes add to it is the
communication that keeps the state identical everywhere. The bench also counts what each
step communicates, exactly: the all-reduces the compiled step runs every step (from its HLO;
the same partitioning for 1 process with 2 devices as for 2 processes) and their bytes.
bf16-mixed (no state) is the reference row: its 2p / 1p is what a second process costs a
stateless step on this machine. Paired ratios of two processes sharing a few cores scatter
by several percent between runs: ``--runs N`` repeats everything and shows the medians and
the range of the global cost.

Prints a table and writes ``runs/bench-multiprocess/results.json``. Not a test: the timings
depend on the machine (on a 2-core CPU box the two processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# How the command line lists this benchmark (studies.app.registry).
NAME = "multiprocess"
SUMMARY = "what keeping precision state global costs, 2 processes vs 1"

__all__ = ["main"]

SETUPS = ("bf16-mixed", "fp16-dynamic", "fp8-delayed")
"""No precision state; loss scale + skip decision; delayed-FP8 amax histories."""

TWINS = {"fp16-dynamic": "fp16", "fp8-delayed": "frozen histories"}
"""Each stateful setup's twin without the state (see the module docstring)."""


_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=(%[\w.\-]+))")


def all_reduces(hlo_text: str) -> tuple[int, int]:
    """(count, bytes) of the all-reduce instructions that compiled HLO text runs every step: a
    combined all-reduce of a tuple counts once, with all its operands' bytes; all-reduces in
    the branches of a conditional are left out (delayed FP8's bootstrap computes its current
    amax in one, taken only before the first recorded step)."""
    branches = {name.strip() for m in _BRANCHES.finditer(hlo_text)
                for name in (m.group(1) or m.group(2)).split(",")}
    count = nbytes = 0
    computation = None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            top = _COMPUTATION.match(line)
            computation = top.group(1) if top else computation
            continue
        m = _ALL_REDUCE.search(line)
        if not m or computation in branches:
            continue
        count += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n * bits // 8
    return count, nbytes


class _Stepper:
    """A step function with its own state, one call = one step on the next batch."""

    def __init__(self, step_fn, state, batches):
        self.step_fn, self.state, self.batches, self.i = step_fn, state, batches, 0

    def __call__(self):
        self.state, metrics = self.step_fn(self.state, self.batches[self.i % len(self.batches)])
        self.i += 1
        return self.state, metrics

    def all_reduces(self) -> tuple[int, int]:
        return all_reduces(self.step_fn.lower(self.state, self.batches[0]).compile().as_text())


def _frozen_fp8(step_fn, cfg):
    """``step_fn`` with the FP8 amax histories kept as they came in: the observations leave
    nothing behind, so XLA drops them and their all-reduce."""
    import jax

    from studies.training import mesh

    def frozen(state, tokens):
        new, metrics = step_fn.__wrapped__(state, tokens)
        return new._replace(fp8_state=state.fp8_state), metrics

    sharding = mesh.state_sharding(cfg.data_parallel)
    return jax.jit(frozen, in_shardings=(sharding, mesh.batch_sharding(cfg.data_parallel)),
                   out_shardings=(sharding, sharding))


ALL_REDUCE_CHAIN = 50
"""Dependent all-reduces in one call when timing one (dispatch and process skew cancel)."""


def _all_reduce_calls(n: int, cfg) -> dict:
    """Two jitted calls on ``n`` f32 amaxes per device: one global max (the one all-reduce
    that delayed FP8's state adds to a step), and ``1 + ALL_REDUCE_CHAIN`` dependent ones;
    the difference of their times / ALL_REDUCE_CHAIN is what one more all-reduce costs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from studies.training import mesh

    x = mesh.put_batch(np.ones((cfg.data_parallel, n), np.float32), cfg.data_parallel)

    def chain(v, k):  # each max waits for the previous one (XLA cannot combine them)
        return jax.lax.fori_loop(0, k, lambda i, v: v + 0.0 * jnp.max(v, axis=0)[None], v)

    one = jax.jit(lambda v: chain(v, 1))
    many = jax.jit(lambda v: chain(v, 1 + ALL_REDUCE_CHAIN))
    return {"all_reduce_x1": lambda: one(x), "all_reduce_chain": lambda: many(x)}


def _worker(setup: str, steps: int, out: str) -> None:
    from studies.training import distributed

    distributed.initialize_from_env()
    from studies.lib.timing import time_samples
    from studies.training import TrainConfig, batch_at, load_data, make_train_step
    from studies.training.mesh import put_batch

    # The tiny LM, batch 8 of 64 bytes (the default TrainConfig sizes): small enough for a
    # shared CPU, big enough that a step is not only dispatch overhead.
    cfg = TrainConfig(steps=steps, batch=8, seq_len=64, warmup=1, corpus_bytes=1 << 16,
                      data_parallel=2)
    data = load_data(cfg)
    batches = [put_batch(batch_at(data, cfg, i), cfg.data_parallel) for i in range(8)]
    init_fn, step_fn = make_train_step(setup, cfg)
    main = _Stepper(step_fn, init_fn(), batches)
    main()  # compiles; and records the histories a frozen twin keeps
    runs = {"setup": main}
    twin = TWINS.get(setup)
    if twin == "frozen histories":
        runs["twin"] = _Stepper(_frozen_fp8(step_fn, cfg), main.state, batches)
    elif twin is not None:
        twin_init, twin_step = make_train_step(twin, cfg)
        runs["twin"] = _Stepper(twin_step, twin_init(), batches)
    res = {k: {"all_reduces": r.all_reduces()} for k, r in runs.items()}
    if twin == "frozen histories":  # the f32 amaxes the state adds to the step's all-reduces
        extra = (res["setup"]["all_reduces"][1] - res["twin"]["all_reduces"][1]) // 4
        runs.update(_all_reduce_calls(extra, cfg))
    time_samples(runs, 3)  # warm-up (and the twins' compiles)
    t = time_samples(runs, steps, alternate=True)
    for k in runs:
        res.setdefault(k, {})["step_ms"] = 1e3 * statistics.median(t[k])
    if "twin" in t:
        res["setup"]["ratio_to_twin"] = statistics.median(
            a / b for a, b in zip(t["setup"], t["twin"]))
    if "all_reduce_chain" in t:
        res["amax_all_reduce"] = {"amaxes": extra, "ms": (
            res["all_reduce_chain"]["step_ms"] - res["all_reduce_x1"]["step_ms"])
            / ALL_REDUCE_CHAIN}
    if distributed.is_primary():
        Path(out).write_text(json.dumps(res))


def _run(setup: str, steps: int, processes: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "r.json")
        worker = [sys.executable, "-m", "studies.bench.multiprocess", "--worker", setup,
                  str(steps), out]
        if processes == 1:
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
            cmd = worker
        else:
            cmd = [sys.executable, "-m", "studies.app.launch", "--num-processes", "2",
                   "--timeout", "600", "--", *worker]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=660)
        if r.returncode:
            raise RuntimeError(f"{setup} on {processes} process(es) failed:\n"
                               f"{r.stderr[-2000:]}")
        return json.loads(Path(out).read_text())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _row(setup: str, one: dict, two: dict) -> dict:
    """One table row from a setup's 1-process and 2-process worker results."""
    row = {"twin": TWINS.get(setup), "one_process_ms": one["setup"]["step_ms"],
           "two_processes_ms": two["setup"]["step_ms"],
           "slowdown": two["setup"]["step_ms"] / one["setup"]["step_ms"],
           "all_reduces": two["setup"]["all_reduces"]}
    if "twin" in two:
        row.update(twin_all_reduces=two["twin"]["all_reduces"],
                   overhead_one_process=one["setup"]["ratio_to_twin"] - 1,
                   overhead_two_processes=two["setup"]["ratio_to_twin"] - 1)
        row["global_state_cost"] = row["overhead_two_processes"] - row["overhead_one_process"]
    if "amax_all_reduce" in two:
        ar = two["amax_all_reduce"]
        row.update(amax_all_reduce_ms=ar["ms"], amaxes_reduced=ar["amaxes"],
                   amax_all_reduce_share=ar["ms"] / row["two_processes_ms"])
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        _worker(argv[1], int(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(prog="fmtkit bench multiprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100,
                   help="timed steps of each step function (interleaved; median)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument("--runs", type=int, default=1,
                   help="repeat each 1- and 2-process run; the table shows medians over runs "
                        "and the range of the global cost")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from studies.lib.common import write_bench_results

    rows = {}
    for s in args.setups:
        runs = [_row(s, _run(s, args.steps, 1), _run(s, args.steps, 2))
                for _ in range(args.runs)]
        rows[s] = {k: (statistics.median(r[k] for r in runs)
                       if isinstance(v, float) else v) for k, v in runs[0].items()}
        if args.runs > 1:
            rows[s]["runs"] = runs
    print(f"{'setup':13} {'1p ms':>6} {'2p ms':>6} {'2p/1p':>6}  {'twin':16} "
          f"{'ovh 1p':>7} {'ovh 2p':>7} {'global':>7}  {'all-reduces (twin)':>18} "
          f"{'bytes (twin)':>17}")
    for s, r in rows.items():
        count, nbytes = r["all_reduces"]
        tc, tb = r.get("twin_all_reduces", ("-", "-"))
        print(f"{s:13} {r['one_process_ms']:6.1f} {r['two_processes_ms']:6.1f} "
              f"{r['slowdown']:6.2f}  {r['twin'] or '-':16} "
              f"{_pct(r.get('overhead_one_process')):>7} "
              f"{_pct(r.get('overhead_two_processes')):>7} "
              f"{_pct(r.get('global_state_cost')):>7}  {f'{count} ({tc})':>18} "
              f"{f'{nbytes} ({tb})':>17}")
        if "runs" in r and "global_state_cost" in r:
            costs = [x["global_state_cost"] for x in r["runs"]]
            print(f"{'':13} global over {len(costs)} runs: {_pct(min(costs))} .. "
                  f"{_pct(max(costs))}")
    print("ovh: median over interleaved pairs of step_ms(setup) / step_ms(twin), - 1; global: "
          "ovh 2p - ovh 1p, what keeping the state identical on every process costs. "
          "All-reduces and bytes per step from the compiled step's HLO.")
    for s, r in rows.items():
        if "amax_all_reduce_ms" in r:
            print(f"{s}: the all-reduce its state adds ({r['amaxes_reduced']} f32 amaxes) "
                  f"takes {r['amax_all_reduce_ms']:.3f} ms between 2 processes (timed in a "
                  f"chain of {ALL_REDUCE_CHAIN}) = {100 * r['amax_all_reduce_share']:.1f}% of "
                  "its step.")
    file = write_bench_results("multiprocess", {"steps": args.steps, "rows": rows}, args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
