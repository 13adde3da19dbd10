"""Benchmark: the study transformer's train step with per-GEMM statistics off vs on.

    fmtkit bench debug-stats [--policy fp8-current] [--freq 10] [--d-model 128]
                             [--layers 2] [--seq 64] [--batch 8] [--rounds 10]
                             [--tensors activation,...] [--stats amax,...]

The steps are ``jax.jit`` of loss + grad + SGD update of ``studies.lib.models.TransformerLM``
under ``with_policy(model, POLICY)``. "off" is the step without ``fmtkit.debug``; "on"
logs every statistic of all six tensors of every GEMM (``Rule("")``) every ``--freq``
steps, the statistics coming out as the gradient of the debug state (``fmtkit.debug``),
with the rules that log passed as the static ``active=config.active_rules(step)`` (two
compiled programs: a logging step, and a quiet one that is the step without statistics, a
Python branch on ``active``); "on-traced" passes the step index as
an array instead (one program, the statistics under ``lax.cond``). A round runs steps 0 ..
``--freq``-1 of the three, interleaved step by step (the order reversed every other round);
printed: the mean step time of each over a round (median over rounds), the logging and the
quiet steps separately, compile times, then the ratio on/off: the median over rounds of the
ratio of the round's means (target: at most 1.10x).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import fmtkit.debug as debug
from fmtkit.policy import list_presets, with_policy
from studies.lib import models
from studies.lib.common import write_bench_results

# How the command line lists this benchmark (studies.app.registry).
NAME = "debug-stats"
SUMMARY = "the study transformer's train step with per-GEMM statistics off vs on"

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

    config = debug.DebugConfig([debug.Rule("", tensors=args.tensors, stats=args.stats,
                                           freq=args.freq)])
    state = debug.init(config, loss, params)

    @jax.jit
    def off(p, i):
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value

    @jax.jit
    def on_traced(p, i):
        def f(p, s):
            with debug.capture(config, s, i):
                return loss(p)

        value, (g, stats) = jax.value_and_grad(f, argnums=(0, 1))(p, state)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value, stats, \
            config.logs_at(i)

    @functools.partial(jax.jit, static_argnames="active")
    def on_static(p, active):
        if not active:  # a quiet step: the step without statistics (no rule logs)
            value, g = jax.value_and_grad(loss)(p)
            return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value, None

        def f(p, s):
            with debug.capture(config, s, active=active):
                return loss(p)

        value, (g, stats) = jax.value_and_grad(f, argnums=(0, 1))(p, state)
        return jax.tree.map(lambda a, b: a - args.lr * b, p, g), value, stats

    def on(p, i):
        return on_static(p, active=config.active_rules(int(i)))

    n_stats = len(jax.tree.leaves(state))
    return off, on, on_traced, params, n_stats


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
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tensors", default=",".join(debug.TENSORS),
                   help="comma-separated tensors to log (default: all six)")
    p.add_argument("--stats", default=",".join(debug.STATS),
                   help="comma-separated statistics to log (default: all)")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-debug-stats)")
    args = p.parse_args(argv)
    args.tensors = tuple(t for t in args.tensors.split(",") if t)
    args.stats = tuple(t for t in args.stats.split(",") if t)
    for name, allowed in (("tensors", debug.TENSORS), ("stats", debug.STATS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad or not getattr(args, name):
            p.error(f"--{name}: unknown or no names {bad}; valid: {', '.join(allowed)}")
    if args.policy not in list_presets():
        p.error(f"--policy: unknown preset {args.policy!r}; valid: {', '.join(list_presets())}")
    for name in ("freq", "d_model", "heads", "layers", "seq", "batch", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")

    off, on, on_traced, params, n_stats = _steps(args)
    variants = {"off": off, "on": on, "on-traced": on_traced}
    compile_s = {}
    for k, fn in variants.items():
        t0 = time.perf_counter()
        for i in (0, 1):  # a logging and a quiet step (compiles each program once)
            jax.block_until_ready(fn(params, jnp.int32(i)))
        compile_s[k] = time.perf_counter() - t0

    # A round runs steps 0 .. freq-1 of every variant, interleaved step by step (the order
    # of the variants reversed every other round), so that the load of a shared machine
    # falls on all of them alike; a round's ratio compares means over the same seconds.
    means: dict[str, list[float]] = {k: [] for k in variants}
    steps: dict[str, list[tuple[bool, float]]] = {k: [] for k in variants}
    load = [round(v, 2) for v in os.getloadavg()]
    for r in range(args.rounds):
        order = list(variants)[:: -1 if r % 2 else 1]
        total = dict.fromkeys(variants, 0.0)
        for i in range(args.freq):
            for k in order:
                t0 = time.perf_counter()
                jax.block_until_ready(variants[k](params, jnp.int32(i)))
                dt = time.perf_counter() - t0
                total[k] += dt
                steps[k].append((i == 0, dt))
        for k in variants:
            means[k].append(total[k] / args.freq)
    mean = {k: statistics.median(v) for k, v in means.items()}
    logging = {k: statistics.median(dt for logged, dt in v if logged) for k, v in steps.items()}
    quiet = {k: statistics.median(dt for logged, dt in v if not logged)
             for k, v in steps.items()}

    def round_ratio(k):
        return statistics.median(a / b for a, b in zip(means[k], means["off"], strict=True))

    ratio = round_ratio("on")
    results: dict[str, Any] = {
        "args": vars(args), "target": TARGET, "statistics_logged": n_stats,
        "mean_step_s": mean, "logging_step_s": logging, "quiet_step_s": quiet,
        "compile_s": compile_s, "ratio_on_off": ratio,
        "ratio_on_traced_off": round_ratio("on-traced"),
        "ratio_of_medians": {k: mean[k] / mean["off"] for k in ("on", "on-traced")},
        "load_average": {"start": load, "end": [round(v, 2) for v in os.getloadavg()]},
    }
    file = write_bench_results("debug-stats", results, args.out)
    print(f"TransformerLM d_model={args.d_model} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}, {args.policy}; {n_stats} statistics every {args.freq} steps; "
          f"device {jax.devices()[0].device_kind}; load {load[0]}")
    for k in variants:
        print(f"  {k:<10} mean step {mean[k] * 1e3:8.2f} ms   (logging step "
              f"{logging[k] * 1e3:.2f} ms, quiet {quiet[k] * 1e3:.2f} ms)   "
              f"compile {compile_s[k]:.1f} s")
    print(f"ratio on-traced/off: {results['ratio_on_traced_off']:.3f}x")
    print(f"results: {file}")
    print(f"ratio on/off (mean step at freq={args.freq}): {ratio:.3f}x (target <= {TARGET}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
