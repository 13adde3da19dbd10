"""Benchmark: the study transformer's train step with per-GEMM statistics off vs on.

    fmtkit bench debug-stats [--policy fp8-current] [--freq 10] [--d-model 128]
                             [--layers 2] [--seq 64] [--batch 8] [--rounds 5]

Both steps are ``jax.jit`` of loss + grad + SGD update of ``studies.models.TransformerLM``
under ``with_policy(model, POLICY)``. "off" is the step without ``fmtkit.debug``; "on"
logs every statistic of all six tensors of every GEMM (``Rule("")``) every ``--freq``
steps, the statistics coming out as the gradient of the debug state (``fmtkit.debug``).
The step index is an argument, so both compile once. A round runs ``--freq`` consecutive
steps of each (one of them a logging step for "on"), in alternation; printed: the mean step
time of each over a round (median over rounds), the logging step and the other steps of
"on" separately, compile times, then the ratio on/off (target: at most 1.10x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import fmtkit.debug as debug
from fmtkit.policy import list_presets, with_policy
from studies import models
from studies.bench._timing import write_results

TARGET = 1.10  # the budget: statistics at freq=10 within 10% of the step without


def _steps(args):
    cfg = models.TransformerConfig(d_model=args.d_model, num_heads=args.heads,
                                   num_layers=args.layers, d_ff=4 * args.d_model,
                                   max_len=args.seq)
    tokens = models.random_tokens(jax.random.key(0), args.batch, args.seq)
    model = with_policy(models.TransformerLM(cfg), args.policy)
    variables = jax.jit(model.init)(jax.random.key(1), tokens)
    params = variables["params"]

    def loss(p):
        return models.lm_loss(model.apply({"params": p}, tokens).astype(jnp.float32), tokens)

    config = debug.DebugConfig([debug.Rule("", freq=args.freq)])
    state = debug.init(config, loss, params)

    @jax.jit
    def off(p, i):
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value

    @jax.jit
    def on(p, i):
        def f(p, s):
            with debug.capture(config, s, i):
                return loss(p)

        value, (g, stats) = jax.value_and_grad(f, argnums=(0, 1))(p, state)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value, stats, \
            config.logs_at(i)

    n_stats = len(jax.tree.leaves(state))
    return off, on, params, n_stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench debug-stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="fp8-current", help="a preset (list_presets())")
    p.add_argument("--freq", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-debug-stats)")
    args = p.parse_args(argv)
    if args.policy not in list_presets():
        p.error(f"--policy: unknown preset {args.policy!r}; valid: {', '.join(list_presets())}")
    for name in ("freq", "d_model", "heads", "layers", "seq", "batch", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")

    off, on, params, n_stats = _steps(args)
    compile_s = {}
    idx = jnp.int32(0)
    for k, fn in (("off", off), ("on", on)):
        t0 = time.perf_counter()
        fn.lower(params, idx).compile()
        compile_s[k] = time.perf_counter() - t0
    # warm-up: one logging and one other step of each
    for i in (0, 1):
        jax.block_until_ready(off(params, jnp.int32(i)))
        jax.block_until_ready(on(params, jnp.int32(i)))

    def round_of(fn, per_step):
        t_round = 0.0
        for i in range(args.freq):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, jnp.int32(i)))
            dt = time.perf_counter() - t0
            t_round += dt
            per_step.append((i % args.freq == 0, dt))
        return t_round / args.freq

    mean_off, mean_on, on_steps, off_steps = [], [], [], []
    load = [round(v, 2) for v in os.getloadavg()]
    for r in range(args.rounds):
        order = [("off", off), ("on", on)][:: -1 if r % 2 else 1]
        for k, fn in order:
            (mean_off if k == "off" else mean_on).append(
                round_of(fn, off_steps if k == "off" else on_steps))
    t_off, t_on = statistics.median(mean_off), statistics.median(mean_on)
    log_step = statistics.median(dt for logged, dt in on_steps if logged)
    quiet = statistics.median(dt for logged, dt in on_steps if not logged)
    ratio = t_on / t_off
    results: dict[str, Any] = {
        "args": vars(args), "target": TARGET, "statistics_logged": n_stats,
        "mean_step_s": {"off": t_off, "on": t_on},
        "on_logging_step_s": log_step, "on_other_step_s": quiet,
        "compile_s": compile_s, "ratio_on_off": ratio,
        "load_average": {"start": load, "end": [round(v, 2) for v in os.getloadavg()]},
    }
    file = write_results("debug-stats", results, args.out)
    print(f"TransformerLM d_model={args.d_model} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}, {args.policy}; {n_stats} statistics every {args.freq} steps; "
          f"device {jax.devices()[0].device_kind}; load {load[0]}")
    print(f"  off  mean step {t_off * 1e3:8.2f} ms   compile {compile_s['off']:.1f} s")
    print(f"  on   mean step {t_on * 1e3:8.2f} ms   compile {compile_s['on']:.1f} s   "
          f"(logging step {log_step * 1e3:.2f} ms, other steps {quiet * 1e3:.2f} ms)")
    print(f"results: {file}")
    print(f"ratio on/off (mean step at freq={args.freq}): {ratio:.3f}x (target <= {TARGET}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
