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
``copy`` instructions of a parameter's shape (``copies``: buffers XLA duplicates per step).
Timing: alternating runs after warm-up, ``block_until_ready``, median of ``--repeats``;
fmtkit and the baseline are timed together first, then the jmp versions with the baseline
again (each ratio is against the baseline of its own phase). Target (issue 22): fmtkit /
optax_f32 <= 1.3x on CPU; the ratio printed last.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fmtkit import optim
from studies.bench._timing import time_interleaved, write_results

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


def param_sized_copies(runner: _Runner) -> int:
    """``copy`` instructions of any parameter's shape in the runner's compiled step."""
    shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves(runner.params)}
    text = runner.step.lower(runner.params, runner.state, runner.grads).compile().as_text()
    found = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", text)
    return sum(1 for shape in found if shape in shapes)


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
    copies = {k: param_sized_copies(r) for k, r in runners.items()}
    times = time_interleaved(runners, args.repeats)
    ratios = {k: t / times["optax_f32"] for k, t in times.items()}
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
            copies[name] = param_sized_copies(runners[name])
        jtimes = time_interleaved(runners, args.repeats)
        for name in ("jmp_select", "jmp_cond"):
            times[name] = jtimes[name]
            ratios[name] = jtimes[name] / jtimes["optax_f32"]
        times["optax_f32_phase2"] = jtimes["optax_f32"]
        ratios["optax_f32_phase2"] = 1.0
        copies["optax_f32_phase2"] = copies["optax_f32"]
        del runners

    print(f"{n:,d} parameters ({len(jax.tree.leaves(p32))} leaves), median of "
          f"{args.repeats}, donated state, {jax.devices()[0].platform}")
    for k, t in times.items():
        print(f"  {k:<16} {t * 1e3:9.2f} ms   {ratios[k]:5.2f}x   "
              f"{copies[k]} parameter-sized copies in the compiled step")
    file = write_results("optim", {"params": n, "width": args.width, "repeats": args.repeats,
                                   "seconds": times, "ratios_vs_optax_f32": ratios,
                                   "param_sized_copies": copies, "jmp": jmp_note}, args.out)
    print(f"wrote {file}")
    print(f"ratio fmtkit / optax_f32: {ratios['fmtkit']:.2f}x  (target <= 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
