"""Study ``loss-scale``: the dynamic loss-scale state machine over a scripted run.

fp16 parameters with float32 masters are trained by
``fmtkit.optim.dynamic_loss_scale(fmtkit.optim.master_weights(optax.sgd(lr)))``. Each step the
true (float32) gradient is a fixed tensor of log-uniform magnitudes in
[grad_min, grad_max] with random signs; the backward pass of the scaled loss is emulated as
``cast(g * S, fp16)`` with S the current loss scale. Scripted events:

* ``spikes``: one gradient element is ``spike_value``; ``spike_value * S`` above fp16's
  range becomes inf, so the step is skipped and the scale backs off until it fits;
* ``nan_steps``: one element is NaN (a bad batch): skipped and backed off although no scale
  can fix it (``consecutive_overflows`` counts such steps).

Otherwise the scale grows by ``growth_factor`` after ``growth_interval`` finite steps (PyTorch
GradScaler: 2^16, x2, x0.5, 2000; here a short interval so that growth shows), until the
ordinary gradients themselves overflow (grad_max * S > 65504): from then on the scale
oscillates just below that point, one skipped step per growth interval, GradScaler's
equilibrium. The table lists each step's scale, action and the fraction of the (nonzero)
gradient that underflowed to 0 in fp16, with the scale and without it (S = 1).

    fmtkit study loss-scale [--steps 64] [--growth-interval 4] [--spikes 3 4 5 14]
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
from fmtkit.casting import cast
from studies.lib.common import figure, format_table, no_progress, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "loss-scale"
SUMMARY = "the dynamic loss-scale state machine over a scripted run with overflows"
ORDER = 40

__all__ = ["Config", "gradients", "plot", "run", "summarize"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``loss-scale`` study.

    Attributes:
      steps: number of steps in the scripted run.
      init_scale: initial loss scale (PyTorch GradScaler: 2^16).
      growth_factor: scale multiplier after growth_interval finite steps.
      backoff_factor: scale multiplier on an overflow.
      growth_interval: finite steps before the scale grows (PyTorch: 2000).
      hysteresis: overflows tolerated before backing off (Megatron; 1 = PyTorch).
      spikes: steps (1-based) where one gradient element is spike_value.
      spike_value: the spiking gradient element (in units of the true, unscaled gradient).
      nan_steps: steps (1-based) where one gradient element is NaN.
      n_grads: number of gradient elements.
      grad_min: smallest gradient magnitude.
      grad_max: largest gradient magnitude (outside the spikes).
      lr: learning rate of the inner SGD.
      seed: seed of the gradient magnitudes and signs.
    """

    steps: int = 64
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 4
    hysteresis: int = 1
    spikes: tuple[int, ...] = (3, 4, 5, 14)
    spike_value: float = 4.0
    nan_steps: tuple[int, ...] = (25,)
    n_grads: int = 4096
    grad_min: float = 1e-12
    grad_max: float = 1e-2
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "growth_interval", "hysteresis", "n_grads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if self.n_grads < 2:
            raise ValueError(f"n_grads must be >= 2 (one spike and one NaN slot), got "
                             f"{self.n_grads}.")
        for name in ("spikes", "nan_steps"):
            bad = [s for s in getattr(self, name) if not 1 <= s <= self.steps]
            if bad:
                raise ValueError(f"{name} must be steps in 1..{self.steps}, got {bad}.")
        if not 0 < self.grad_min < self.grad_max:
            raise ValueError(f"need 0 < grad_min < grad_max, got {self.grad_min}, "
                             f"{self.grad_max}.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}.")
        if not math.isfinite(self.spike_value):
            raise ValueError(f"spike_value must be finite, got {self.spike_value}.")
        # The scale hyperparameters are validated by optim.dynamic_loss_scale itself.
        optim.dynamic_loss_scale(optax.sgd(self.lr), init_scale=self.init_scale,
                                 growth_factor=self.growth_factor,
                                 backoff_factor=self.backoff_factor,
                                 growth_interval=self.growth_interval,
                                 hysteresis=self.hysteresis)


def gradients(config: Config) -> np.ndarray:
    """The scripted float32 gradients, shape [steps, n_grads] (the same tensor each step,
    element 0 replaced by the spike and element 1 by NaN on the scripted steps)."""
    rng = np.random.default_rng(config.seed)
    mags = np.exp(rng.uniform(math.log(config.grad_min), math.log(config.grad_max),
                              config.n_grads))
    base = (mags * rng.choice([-1.0, 1.0], config.n_grads)).astype(np.float32)
    g = np.repeat(base[None, :], config.steps, axis=0)
    for s in config.spikes:
        g[s - 1, 0] = config.spike_value
    for s in config.nan_steps:
        g[s - 1, 1] = np.nan
    return g


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Per step: the scale used, whether the fp16 gradients overflowed, the next scale, the
    optimizer's counters, whether the parameters changed, and the underflow fractions.

    Returns:
      ``{"steps": [{"step", "event", "scale", "overflow", "next_scale", "growth_tracker",
      "skipped_steps", "consecutive_overflows", "params_changed", "underflow_scaled",
      "underflow_unscaled"}, ...], ...}``.
    """
    opt = optim.dynamic_loss_scale(
        optim.master_weights(optax.sgd(config.lr)), init_scale=config.init_scale,
        growth_factor=config.growth_factor, backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval, hysteresis=config.hysteresis)
    params = jnp.zeros((config.n_grads,), jnp.float16)
    state = opt.init(params)

    @jax.jit
    def step(params, state, g32):
        scale = optim.loss_scale(state)
        g16 = cast(g32 * scale, "fp16")  # the fp16 backward pass of the scaled loss
        updates, new_state = opt.update(g16, state, params)
        new_params = optim.add_updates(params, updates)  # = optax.apply_updates
        nonzero = (g32 != 0) & jnp.isfinite(g32)
        n = jnp.sum(nonzero, dtype=jnp.float32)
        flushed = jnp.sum(nonzero & (g16 == 0), dtype=jnp.float32) / n
        flushed_unscaled = jnp.sum(nonzero & (cast(g32, "fp16") == 0), dtype=jnp.float32) / n
        info = {
            "scale": scale,
            "overflow": ~optim.all_finite(g16),
            "next_scale": new_state.loss_scale,
            "growth_tracker": new_state.growth_tracker,
            "skipped_steps": new_state.skipped_steps,
            "consecutive_overflows": new_state.consecutive_overflows,
            "params_changed": jnp.any(new_params != params),
            "underflow_scaled": flushed,
            "underflow_unscaled": flushed_unscaled,
        }
        return new_params, new_state, info

    grads = gradients(config)
    rows = []
    for i in progress(range(config.steps), total=config.steps, desc="steps"):
        params, state, info = step(params, state, jnp.asarray(grads[i]))
        info = jax.device_get(info)
        event = ("nan" if (i + 1) in config.nan_steps else
                 "spike" if (i + 1) in config.spikes else "")
        rows.append({"step": i + 1, "event": event,
                     **{k: (bool(v) if np.asarray(v).dtype == np.bool_ else
                            int(v) if np.issubdtype(np.asarray(v).dtype, np.integer) else
                            float(v)) for k, v in info.items()}})
    return {
        "steps": rows,
        "final_scale": rows[-1]["next_scale"],
        "skipped_steps": rows[-1]["skipped_steps"],
        "fp16_max": 65504.0,
        "spike_value": config.spike_value,
        "growth_interval": config.growth_interval,
    }


def _action(r: dict[str, Any]) -> str:
    if r["overflow"]:
        return "skip, back off" if r["next_scale"] < r["scale"] else "skip"
    if r["next_scale"] > r["scale"]:
        return "update, grow"
    return "update"


def summarize(results: dict[str, Any]) -> str:
    """The step table."""
    rows = [[r["step"], r["event"], f"2^{math.log2(r['scale']):g}",
             "inf/nan" if r["overflow"] else "finite", _action(r),
             f"2^{math.log2(r['next_scale']):g}", r["growth_tracker"], r["skipped_steps"],
             f"{100 * r['underflow_scaled']:.1f}%", f"{100 * r['underflow_unscaled']:.1f}%"]
            for r in results["steps"]]
    return format_table(
        ["step", "event", "scale", "fp16 grads", "action", "next scale", "tracker", "skipped",
         "flushed", "flushed at S=1"], rows,
        title=f"Dynamic loss scaling (growth interval {results['growth_interval']}, spike "
              f"{results['spike_value']:g})") + (
        f"\nfinal scale 2^{math.log2(results['final_scale']):g}, "
        f"{results['skipped_steps']} steps skipped")


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``loss_scale.png``: the scale per step (log2) with overflows marked, and underflow."""
    rows = results["steps"]
    steps = np.array([r["step"] for r in rows])
    with plot_style():
        fig, (ax, ax2) = figure(2, 1, width=7.0, height=5.6)
        ax.step(steps, [math.log2(r["scale"]) for r in rows], where="mid", color="#1f77b4",
                label="scale used (log2)")
        for r in rows:
            if r["overflow"]:
                ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="#d62728", alpha=0.15, lw=0)
                ax.plot(r["step"], math.log2(r["scale"]), "x", color="#d62728")
        ax.plot([], [], "x", color="#d62728", label="overflow: step skipped")
        ax.set_ylabel("log2 loss scale")
        ax.set_title("Dynamic loss scale over a scripted run (red: inf/NaN gradients)")
        ax.legend(loc="lower right")
        ax2.plot(steps, [100 * r["underflow_scaled"] for r in rows], color="#2ca02c",
                 label="with the loss scale")
        ax2.plot(steps, [100 * r["underflow_unscaled"] for r in rows], "--", color="#7f7f7f",
                 label="without scaling (S = 1)")
        ax2.set_xlabel("step")
        ax2.set_ylabel("gradients flushed to 0 (%)")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="center right")
        return [save(fig, out_dir, "loss_scale")]
