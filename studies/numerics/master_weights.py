"""Study ``master-weights``: why the optimizer keeps a float32 copy of bf16/fp16 weights.

A weight starts at 1.0 and receives the update +1e-3 a thousand times (learning rate x
gradient), accumulated in different ways:

* directly in float32, bfloat16 and float16 (``w = round(w + u)`` in that dtype);
* bf16 and fp16 parameters with float32 masters (``fmtkit.optim.master_weights`` around
  ``optax.sgd``): the update is added to the master, the parameter is ``round(master)``;
* bf16 parameters without masters, with stochastic rounding of each update
  (``fmtkit.optim.stochastic_round_updates``; the mean over many elements) or Kahan
  compensation (``fmtkit.optim.kahan_updates``).

Expected, from the format definitions: bf16's spacing in [1, 2) is 2^-7 = 0.0078, so
1 + 1e-3 rounds back to 1 and bf16 never moves; fp16's spacing there is 2^-10 = 0.000977, so
each step adds 0.000977 and 1000 steps reach 1 + 1000 * 2^-10 = 1.9766, not 2. In [2, 4) the
spacing 2^-9 makes 1e-3 round *up* to 0.00195; in [4, 8) the update is under half the
spacing (0.00195) and is lost: from 1.0, fp16 stalls at 4.0 after 2048 steps, whatever the
number of steps after that (the ``stall`` run).

    fmtkit study master-weights [--steps 1000] [--update 1e-3] [--stall-steps 5000]
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit import optim
from studies.lib.common import FORMAT_COLORS, figure, format_table, no_progress, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "master-weights"
SUMMARY = "1.0 + 1e-3 a thousand times in bf16, fp16, f32 and with f32 masters"
ORDER = 30

__all__ = ["Config", "plot", "run", "summarize"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``master-weights`` study.

    Attributes:
      steps: number of updates in the main comparison.
      update: the update added each step (learning rate x gradient).
      init: the starting weight.
      stall_steps: number of fp16 steps in the stall run (0: skip it).
      sr_elements: elements averaged for the stochastic-rounding path.
      seed: seed of the stochastic rounding.
      record_every: keep every k-th point of the trajectories in the results.
    """

    steps: int = 1000
    update: float = 1e-3
    init: float = 1.0
    stall_steps: int = 5000
    sr_elements: int = 1024
    seed: int = 0
    record_every: int = 10

    def __post_init__(self):
        for name in ("steps", "sr_elements", "record_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if not isinstance(self.stall_steps, int) or self.stall_steps < 0:
            raise ValueError(f"stall_steps must be an int >= 0, got {self.stall_steps!r}.")
        if not (math.isfinite(self.update) and self.update > 0):
            raise ValueError(f"update must be a positive finite number, got {self.update!r}.")
        if not (math.isfinite(self.init) and self.init > 0):
            raise ValueError(f"init must be a positive finite number, got {self.init!r}.")


# The trajectories leave the scans in the parameters' own dtype and are widened in NumPy:
# under jit, XLA (xla_allow_excess_precision, on by default) may drop the rounding of a bf16
# sum that is immediately converted to f32, which would record 1.001 for bf16's 1 + 1e-3.


def _direct(dtype: Any, init: float, update: float, steps: int) -> jax.Array:
    """Trajectory of ``w = round(w + u)`` in ``dtype`` (u rounded to dtype once)."""
    u = jnp.asarray(update, dtype)

    def body(w, _):
        w = w + u
        return w, w

    return jax.lax.scan(body, jnp.asarray(init, dtype), None, length=steps)[1]


def _optax(opt: optax.GradientTransformation, params: jax.Array, steps: int,
           apply: Any) -> jax.Array:
    """Trajectory [steps, *params.shape] of SGD steps with gradient -1 through ``opt``."""
    grads = -jnp.ones_like(params)

    def body(carry, _):
        p, s = carry
        u, s = opt.update(grads, s, p)
        p = apply(p, u, s)
        return (p, s), p

    return jax.lax.scan(body, (params, opt.init(params)), None, length=steps)[1]


def _paths(config: Config) -> dict[str, tuple[str, Any]]:
    """name -> (description, zero-argument function returning the trajectory)."""
    n, u, w0 = config.steps, config.update, config.init
    bf16, f16 = jnp.bfloat16, jnp.float16
    sgd = optax.sgd(u)  # gradient -1: each step adds exactly f32(u) to the master

    def plain(p, _u, _state):  # optax.apply_updates, also under strict dtype promotion
        return optim.add_updates(p, _u)

    return {
        "float32": ("f32 weights", lambda: _direct(F32, w0, u, n)),
        "bfloat16": ("bf16 weights", lambda: _direct(bf16, w0, u, n)),
        "float16": ("fp16 weights", lambda: _direct(f16, w0, u, n)),
        "bf16_master": ("bf16 params, f32 master (optim.master_weights)",
                        lambda: _optax(optim.master_weights(sgd), jnp.full((1,), w0, bf16), n,
                                       plain)),
        "fp16_master": ("fp16 params, f32 master (optim.master_weights)",
                        lambda: _optax(optim.master_weights(sgd), jnp.full((1,), w0, f16), n,
                                       plain)),
        "bf16_stochastic": (f"bf16, stochastic rounding (mean of {config.sr_elements})",
                            lambda: _optax(optim.stochastic_round_updates(sgd, seed=config.seed),
                                           jnp.full((config.sr_elements,), w0, bf16), n,
                                           lambda p, du, s: plain(p, du, s))),
        "bf16_kahan": ("bf16, Kahan-compensated (optim.kahan_updates)",
                       lambda: _optax(optim.kahan_updates(sgd), jnp.full((1,), w0, bf16), n,
                                      lambda p, du, s: plain(p, du, s))),
    }


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Final weights and trajectories of each accumulation path, and the fp16 stall run.

    Returns:
      ``{"final": {path: w}, "expected_exact": ..., "trajectories": {path: [...]},
      "stall": {...}, ...}``; trajectories hold the weight after steps
      ``record_every, 2 * record_every, ...``.
    """
    paths = _paths(config)
    k = config.record_every
    final, traj, labels = {}, {}, {}
    for name in progress(list(paths), total=len(paths), desc="paths"):
        label, fn = paths[name]
        t = np.asarray(jax.jit(fn)()).astype(np.float64)  # widened outside XLA
        t = t.reshape(t.shape[0], -1).mean(axis=1)  # mean over elements (stochastic path)
        final[name] = float(t[-1])
        traj[name] = t[k - 1::k].tolist()
        labels[name] = label
    out: dict[str, Any] = {
        "steps": config.steps,
        "update": config.update,
        "init": config.init,
        # float64 reference for init + steps * update (no rounding to speak of).
        "expected_exact": config.init + config.steps * config.update,
        "final": final,
        "labels": labels,
        "record_every": k,
        "trajectories": traj,
    }
    if config.stall_steps:
        t = np.asarray(jax.jit(lambda: _direct(jnp.float16, config.init, config.update,
                                               config.stall_steps))()).astype(np.float64)
        changed = np.flatnonzero(np.diff(np.concatenate([[config.init], t])) != 0)
        last_change = int(changed[-1]) + 1 if changed.size else 0  # 1-based step
        out["stall"] = {
            "steps": config.stall_steps,
            "final": float(t[-1]),
            "last_change_step": last_change,
            "stalled": last_change < config.stall_steps,
            "trajectory": t[k - 1::k].tolist(),
        }
    return out


def summarize(results: dict[str, Any]) -> str:
    """Final weight of each path."""
    exact = results["expected_exact"]
    rows = [[results["labels"][n], f"{w:.4f}", f"{w - exact:+.4f}"]
            for n, w in results["final"].items()]
    table = format_table(
        ["path", "final weight", "vs exact"], rows,
        title=f"{results['init']:g} + {results['update']:g} x {results['steps']} "
              f"(exact: {exact:.4f})")
    if "stall" in results:
        s = results["stall"]
        table += (f"\nfp16 from {results['init']:g}, {s['steps']} steps: {s['final']:.4f} "
                  f"(last change at step {s['last_change_step']}"
                  f"{', stalled' if s['stalled'] else ''})")
    return table


_COLORS = {"float32": FORMAT_COLORS["float32"], "bfloat16": FORMAT_COLORS["bfloat16"],
           "float16": FORMAT_COLORS["float16"], "bf16_master": "#17becf",
           "fp16_master": "#e377c2", "bf16_stochastic": "#bcbd22", "bf16_kahan": "#8c564b"}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``master_weights.png``: the trajectories, and the fp16 stall run beside them."""
    has_stall = "stall" in results
    k = results["record_every"]
    with plot_style():
        fig, axes = figure(1, 2 if has_stall else 1, width=11.0 if has_stall else 6.4,
                           height=4.2)
        ax = axes[0] if has_stall else axes
        for name, t in results["trajectories"].items():
            steps = np.arange(1, len(t) + 1) * k
            ls = ":" if name in ("bf16_stochastic", "bf16_kahan") else (
                "--" if name.endswith("master") else "-")
            ax.plot(steps, t, ls, color=_COLORS.get(name), label=results["labels"][name])
        ax.set_xlabel("step")
        ax.set_ylabel("weight")
        ax.set_title(f"{results['init']:g} + {results['update']:g} per step")
        ax.legend(fontsize=7)
        if has_stall:
            s = results["stall"]
            steps = np.arange(1, len(s["trajectory"]) + 1) * k
            ax2 = axes[1]
            ax2.plot(steps, results["init"] + steps * results["update"], color=_COLORS["float32"],
                     label="exact")
            ax2.plot(steps, s["trajectory"], color=_COLORS["float16"], label="fp16 weights")
            ax2.axvline(s["last_change_step"], color="k", lw=0.6, alpha=0.5)
            ax2.set_xlabel("step")
            ax2.set_title(f"fp16 stalls at {s['final']:g} after step {s['last_change_step']}")
            ax2.legend(fontsize=7)
        return [save(fig, out_dir, "master_weights")]
