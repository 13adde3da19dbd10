"""Benchmark: a jitted step of ``dynamic_loss_scale(master_weights(adamw))`` vs plain ``adamw``.

    fmtkit bench optim [--params 10000000] [--width 1024] [--repeats 20] [--no-jmp]

* ``fmtkit``: bf16 parameters, scaled bf16 gradients, ``dynamic_loss_scale(master_weights(
  optax.adamw(1e-3)))`` and ``optax.apply_updates``.
* ``optax_f32`` (the baseline): f32 parameters and gradients, ``optax.adamw(1e-3)`` and
  ``optax.apply_updates``.
* ``jmp_select`` / ``jmp_cond``: the same step composed as jmp's README documents it
  (``jmp.DynamicLossScale``: unscale the gradients in their own dtype, ``jmp.all_finite``,
  ``adjust``, the optimizer on an f32 master copy, ``jmp.select_tree`` to keep the old state
  on a non-finite step; ``jmp_cond`` skips with ``lax.cond`` instead). jmp is not a
  dependency: the few lines of jmp 0.0.4 it uses are written out here (``_JmpLossScale``).

Every step is jitted with the parameters and optimizer state donated and runs on the same
gradient tree (finite, so every step applies). For each step the compiled HLO is read for
``copy`` instructions of a parameter's shape (``copies``: buffers XLA duplicates per step),
and for its kernels over parameter-sized buffers (``passes``) and the bytes they read and
write per parameter (``B/param``; ``hlo_traffic``): the byte floor is 28 B/param for plain
f32 adamw (read p, g, mu, nu; write p, mu, nu) and 30 for the chain (bf16 p and g, f32
master, mu, nu); XLA:CPU makes one loop per output array (it has no multi-output fusion).
Timing: alternating runs after warm-up (the order reversed every other round),
``block_until_ready``, median of ``--repeats``, wall time and CPU time of the process;
fmtkit and the baseline are timed together first, then the jmp versions with the baseline
again (each ratio is against the baseline of its own phase). Target: fmtkit /
optax_f32 <= 1.3x on CPU; the ratio printed last.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fmtkit import optim
from studies.lib.common import write_bench_results
from studies.lib.timing import time_samples

# How the command line lists this benchmark (studies.app.registry).
NAME = "optim"
SUMMARY = "a step of dynamic_loss_scale(master_weights(adamw)) vs plain adamw"

_LR = 1e-3
_SCALE = 2.0**16  # the scale the gradients were computed with (GradScaler's default init)


def make_params(n_params: int, width: int, dtype: Any, key: jax.Array) -> dict[str, Any]:
    """A dict of (width, width) weights and (width,) biases with at least ``n_params``."""
    per_layer = width * width + width
    n_layers = -(-n_params // per_layer)
    keys = jax.random.split(key, n_layers)
    return {f"layer{i}": {"w": (0.02 * jax.random.normal(k, (width, width))).astype(dtype),
                          "b": jnp.zeros((width,), dtype)} for i, k in enumerate(keys)}


def _fmtkit_step(opt: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return jax.jit(step, donate_argnums=(0, 1))


def _optax_step(opt: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return jax.jit(step, donate_argnums=(0, 1))


class _JmpLossScale:
    """jmp 0.0.4's ``DynamicLossScale`` (period 2000, factor 2, min scale 1), its
    ``all_finite`` and ``select_tree``, written out: the composition jmp documents."""

    def __init__(self, loss_scale: jax.Array, counter: jax.Array | None = None):
        self.loss_scale = loss_scale
        self.counter = jnp.zeros([], jnp.int32) if counter is None else counter

    def unscale(self, tree: Any) -> Any:  # in the gradients' own dtype, as jmp does
        inv = 1 / self.loss_scale
        return jax.tree.map(lambda x: x * inv.astype(x.dtype), tree)

    def adjust(self, finite: jax.Array) -> _JmpLossScale:
        period, factor = 2000, 2
        grown = jnp.where(self.counter == period - 1, self.loss_scale * factor, self.loss_scale)
        scale = jnp.where(finite, grown,
                          jnp.maximum(jnp.float32(1), self.loss_scale / factor))
        counter = ((self.counter + 1) % period) * finite.astype(jnp.int32)
        return _JmpLossScale(scale, counter)

    @staticmethod
    def all_finite(tree: Any) -> jax.Array:
        return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]).all()

    @staticmethod
    def select_tree(pred: jax.Array, a: Any, b: Any) -> Any:
        return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)


jax.tree_util.register_pytree_node(
    _JmpLossScale, lambda s: ((s.loss_scale, s.counter), None),
    lambda _, leaves: _JmpLossScale(*leaves))


def _jmp_step(opt: optax.GradientTransformation, use_cond: bool) -> Callable:
    def step(params, state, grads):
        master, opt_state, scale = state
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), scale.unscale(grads))
        finite = _JmpLossScale.all_finite(grads)
        new_scale = scale.adjust(finite)

        def apply(operand):
            m, s = operand
            updates, s = opt.update(grads, s, m)
            return optax.apply_updates(m, updates), s

        if use_cond:
            master, opt_state = jax.lax.cond(finite, apply, lambda o: o, (master, opt_state))
        else:
            master, opt_state = _JmpLossScale.select_tree(
                finite, apply((master, opt_state)), (master, opt_state))
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        return params, (master, opt_state, new_scale)
    return jax.jit(step, donate_argnums=(0, 1))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*?)\)(.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_NOT_A_PASS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "conditional"}


def _arrays(shape_text: str) -> list[tuple[str, str]]:
    """(dtype, dims) of every array in an HLO shape (an array or a tuple of arrays)."""
    return _ARRAY.findall(shape_text)


def hlo_traffic(hlo_text: str, param_dims: set[str]) -> dict[str, int]:
    """Passes over parameter-sized buffers in a compiled step, and the bytes they move.

    Reads the compiled HLO text: every kernel (a fusion, a copy, any other instruction that
    is not bookkeeping) in the entry computation whose output or an operand has a
    parameter's dimensions (``param_dims``: "1024,1024"-style strings, any dtype) counts as
    one pass, and moves the bytes of all its operands and outputs (XLA:CPU makes one loop per
    fusion output: it has no multi-output fusion). At a ``conditional`` it follows the
    branch a finite step takes: the last one (the true branch of ``lax.cond``: the update
    branch of the loss scalers and of ``jmp_cond``, the fast branch of ``all_finite``).
    A byte count, not a time: it ignores caches, and what each loop computes.

    Returns:
      ``{"passes": ..., "bytes": ...}`` for one step.
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")

    def walk(name: str) -> tuple[int, int]:
        shapes, passes, moved = {}, 0, 0
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            out, shape, op, operands, attrs = m.groups()
            shapes[out] = shape
            if op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                taken = (branches.group(1).split(",")[-1] if branches else
                         re.search(r"true_computation=(%\S+?),", attrs).group(1))
                p, b = walk(taken.strip().lstrip("%"))
                passes, moved = passes + p, moved + b
                continue
            if op in _NOT_A_PASS:
                continue
            arrays = _arrays(shape) + [a for o in operands.split(",")
                                       for a in _arrays(shapes.get(o.strip().lstrip("%"), ""))]
            if any(dims in param_dims for _, dims in arrays):
                passes += 1
                moved += sum(_DTYPE_BYTES.get(dt, 4) * math.prod(
                    int(d) for d in dims.split(",") if d) for dt, dims in arrays)
        return passes, moved

    passes, moved = walk(entry)
    return {"passes": passes, "bytes": moved}


def compiled_text(runner: _Runner) -> str:
    return runner.step.lower(runner.params, runner.state, runner.grads).compile().as_text()


def param_sized_copies(runner: _Runner, text: str | None = None) -> int:
    """``copy`` instructions of any parameter's shape in the runner's compiled step."""
    shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves(runner.params)}
    found = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", text or compiled_text(runner))
    return sum(1 for shape in found if shape in shapes)


def wall_interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time (s) per call after 3 warm-up calls each, in alternation with the
    order reversed every other repeat (the position in a round moved a ratio by about 0.02
    on the shared 2-core machine)."""
    for fn in fns.values():
        for _ in range(3):
            jax.block_until_ready(fn())
    samples = time_samples(fns, repeats, alternate=True)
    return {k: statistics.median(v) for k, v in samples.items()}


def cpu_interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median CPU time (s, all threads of this process: ``time.process_time``) per call of
    already warm zero-argument callables, in alternation. On a machine shared with other
    jobs the wall time includes waiting for a core and the CPU time does not, so the ratio
    of CPU times is the steadier measure of the work each step does (under load, 2 cores:
    plain adamw's CPU time varied by a few percent where its wall time varied 2x)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats):
        for k in (list(fns)[::-1] if i % 2 else list(fns)):
            t0 = time.process_time()
            jax.block_until_ready(fns[k]())
            samples[k].append(time.process_time() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


class _Runner:
    """Threads donated (params, state) through repeated calls of a step."""

    def __init__(self, step: Callable, params: Any, state: Any, grads: Any):
        self.step, self.params, self.state, self.grads = step, params, state, grads

    def __call__(self) -> Any:
        self.params, self.state = self.step(self.params, self.state, self.grads)
        return self.params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench optim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=10_000_000, help="parameter count (min)")
    p.add_argument("--width", type=int, default=1024, help="layer width")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-jmp", action="store_true", help="skip the jmp columns")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-optim)")
    args = p.parse_args(argv)
    if args.params <= 0 or args.width <= 0 or args.repeats <= 0:
        p.error("--params, --width and --repeats must be positive")

    key_p, key_g = jax.random.split(jax.random.key(0))
    p32 = make_params(args.params, args.width, jnp.float32, key_p)
    g32 = jax.tree.map(lambda x, k: 1e-3 * jax.random.normal(k, x.shape), p32,
                       optax.tree.split_key_like(key_g, p32))
    n = optax.tree.size(p32)
    scaled_bf16 = jax.tree.map(lambda g: (g * _SCALE).astype(jnp.bfloat16), g32)

    adamw = optax.adamw(_LR)
    ours = optim.dynamic_loss_scale(optim.master_weights(adamw))

    def baseline() -> _Runner:
        p_base = jax.tree.map(jnp.copy, p32)
        return _Runner(_optax_step(adamw), p_base, jax.jit(adamw.init)(p_base), g32)

    # Phase 1: fmtkit against the baseline, alone (the headline ratio).
    pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    runners = {"fmtkit": _Runner(_fmtkit_step(ours), pb, jax.jit(ours.init)(pb), scaled_bf16),
               "optax_f32": baseline()}
    dims = {",".join(map(str, x.shape)) for x in jax.tree.leaves(p32)}
    copies, traffic = {}, {}

    def profile(name: str, runner: _Runner) -> None:
        text = compiled_text(runner)
        copies[name] = param_sized_copies(runner, text)
        traffic[name] = hlo_traffic(text, dims)

    for k, r in runners.items():
        profile(k, r)
    times = wall_interleaved(runners, args.repeats)
    ratios = {k: t / times["optax_f32"] for k, t in times.items()}
    cpu = cpu_interleaved(runners, args.repeats)
    cpu_ratios = {k: t / cpu["optax_f32"] for k, t in cpu.items()}
    del runners, pb

    # Phase 2: the jmp compositions against the baseline (separately, so that their larger
    # working sets do not slow down the phase-1 measurement).
    jmp_note = "skipped (--no-jmp)"
    if not args.no_jmp:
        jmp_note = "jmp 0.0.4's composition, written out (studies/bench/optim.py)"
        runners = {"optax_f32": baseline()}
        for name, use_cond in (("jmp_select", False), ("jmp_cond", True)):
            pj = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
            master = jax.tree.map(lambda x: x.astype(jnp.float32), pj)
            state = (master, jax.jit(adamw.init)(master),
                     _JmpLossScale(jnp.asarray(_SCALE, jnp.float32)))
            runners[name] = _Runner(_jmp_step(adamw, use_cond), pj, state, scaled_bf16)
            profile(name, runners[name])
        jtimes = wall_interleaved(runners, args.repeats)
        jcpu = cpu_interleaved(runners, args.repeats)
        for name in ("jmp_select", "jmp_cond"):
            times[name] = jtimes[name]
            ratios[name] = jtimes[name] / jtimes["optax_f32"]
            cpu[name] = jcpu[name]
            cpu_ratios[name] = jcpu[name] / jcpu["optax_f32"]
        times["optax_f32_phase2"] = jtimes["optax_f32"]
        ratios["optax_f32_phase2"] = 1.0
        cpu["optax_f32_phase2"], cpu_ratios["optax_f32_phase2"] = jcpu["optax_f32"], 1.0
        copies["optax_f32_phase2"] = copies["optax_f32"]
        traffic["optax_f32_phase2"] = traffic["optax_f32"]
        del runners

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"{n:,d} parameters ({len(jax.tree.leaves(p32))} leaves), median of "
          f"{args.repeats}, donated state, {jax.devices()[0].platform}"
          + (f", load average {load[0]:.1f}" if load else ""))
    print(f"  {'step':<16} {'time':>12} {'ratio':>7} {'cpu':>10} {'ratio':>7} {'copies':>7} "
          f"{'passes':>7} {'B/param':>8}   (wall and CPU time; parameter-sized copies, "
          "kernels and bytes in the compiled step)")
    for k, t in times.items():
        print(f"  {k:<16} {t * 1e3:9.2f} ms {ratios[k]:6.2f}x {cpu[k] * 1e3:7.2f} ms "
              f"{cpu_ratios[k]:6.2f}x {copies[k]:7d} {traffic[k]['passes']:7d} "
              f"{traffic[k]['bytes'] / n:8.1f}")
    file = write_bench_results("optim", {"params": n, "width": args.width, "repeats": args.repeats,
                                   "load_average": load, "seconds": times,
                                   "ratios_vs_optax_f32": ratios, "cpu_seconds": cpu,
                                   "cpu_ratios_vs_optax_f32": cpu_ratios,
                                   "param_sized_copies": copies,
                                   "hlo_passes": {k: v["passes"] for k, v in traffic.items()},
                                   "hlo_bytes_per_param": {k: v["bytes"] / n
                                                           for k, v in traffic.items()},
                                   "jmp": jmp_note}, args.out)
    print(f"wrote {file}")
    print(f"ratio fmtkit / optax_f32: {ratios['fmtkit']:.2f}x  (target <= 1.3x; CPU time "
          f"{cpu_ratios['fmtkit']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
