"""Study ``grad-blocks``: 128x128 vs 1x128 activation-gradient blocks under token-correlated
gradient outliers, with a divergence monitor in the loop.

DeepSeek-V3 (arXiv 2412.19437, App. B.2) quantized activation gradients in 128x128 blocks
like its weights and saw a 16B MoE diverge after ~300B tokens; it blamed token-correlated
outliers (a few tokens with much larger gradients: one in a 128-token block sets the scale
of the whole block) and kept 1x128 tiles (one token each). This study gives the tiny LM
such outliers (``studies.lib.regimes.TokenGradOutliers``: 1/256 of the predicted tokens
weighted ``magnitude`` times the others in the loss whose gradient is taken, new
positions every step) at magnitudes 1e2, 1e3 and 1e4, and trains bf16-mixed, fp8-blockwise
(1x128 gradient tiles) and fp8-blockwise-g128 (the same with 128x128 activation-gradient
blocks), seeds paired. Every step records the divergence monitor
(``studies.training.monitor``): the gradient's global norm, its non-finite elements, and
loss spikes (a loss above 1.1x the median of the 20 steps before it), so the failure mode
is looked for rather than assumed. Reported per magnitude: the paired final-loss gap of
g128 to blockwise and of each to bf16-mixed, spikes, non-finite steps and the largest
gradient norm.

    fmtkit study grad-blocks [--magnitudes 1e2 1e3 1e4] [--steps 150] [--seeds 3]
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from studies.lib import stats
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lm.fp8_recipes import EXTRA_RECIPES
from studies.training import fp8_training as ft
from studies.training.config import TrainConfig
from studies.training.data import load_data
from studies.training.setups import get_setup

# How the command line lists this study (studies.app.registry).
NAME = "grad-blocks"
SUMMARY = "128x128 vs 1x128 activation-gradient blocks vs token-gradient outliers"
ORDER = 170

__all__ = ["Config", "plot", "run", "setups", "summarize"]

FINE, COARSE = "fp8-blockwise", "fp8-blockwise-g128"


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``grad-blocks`` study.

    Attributes:
      magnitudes: gradient-outlier magnitudes (the outlier tokens' loss weight over the
        others').
      parallel: setups trained at once (threads).
      resume: a units folder of an earlier run (units found there are reused).
      work_dir: where a new run's units folder goes.
      train: the training settings (the main job's tiny model by default).
    """

    magnitudes: tuple[float, ...] = (1e2, 1e3, 1e4)
    parallel: int = 2
    resume: str | None = None
    work_dir: str = "runs/units"
    train: TrainConfig = TrainConfig(steps=150, seeds=3)

    def __post_init__(self):
        ft.check_magnitudes(self.magnitudes)
        ft.check_parallel(self.parallel)
        ft.check_resume(self.resume)


def setups() -> dict[str, Any]:
    """bf16-mixed, fp8-blockwise and fp8-blockwise-g128, by name."""
    return {"bf16-mixed": get_setup("bf16-mixed"), FINE: get_setup(FINE),
            COARSE: ft.fp8_setup(COARSE, EXTRA_RECIPES["blockwise-g128"])}


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains every setup at every magnitude and seed (one vmapped unit per setup).

    Returns:
      ``{"magnitudes", "seeds", "units": {setup: unit}, "gaps": {"g128_vs_blockwise" |
      setup + "_vs_bf16": [gap per magnitude]}, "monitor": {setup: [per magnitude: spikes,
      non-finite steps, max grad norm, per seed]}, ...}``.
    """
    t0 = time.perf_counter()
    cfg = dataclasses.replace(config.train, regime="none")
    data = load_data(cfg)
    runs = tuple(ft.Run(s, 1.0, float(m)) for m in config.magnitudes for s in cfg.seed_list)
    folder = ft.units_folder(config.resume, config.work_dir, "grad-blocks")
    named = setups()

    def train(name):
        return ft.train_unit(named[name], cfg, runs, grad_outliers=True, progress=progress,
                             data=data, cache=folder, study="grad-blocks")

    with ThreadPoolExecutor(config.parallel) as pool:
        units = dict(zip(named, pool.map(train, named)))

    def losses(name, m):
        return ft.final_losses(units[name], grad_magnitude=float(m))

    gaps = {"g128_vs_blockwise": [stats.compare(losses(FINE, m), losses(COARSE, m),
                                                paired=True).to_dict()
                                  for m in config.magnitudes]}
    for n in (FINE, COARSE):
        gaps[f"{n}_vs_bf16"] = [stats.compare(losses("bf16-mixed", m), losses(n, m),
                                              paired=True).to_dict()
                                for m in config.magnitudes]
    monitor = {}
    for name, u in units.items():
        per_mag = []
        for m in config.magnitudes:
            rs = [r for r in u["runs"] if r["grad_magnitude"] == float(m)]
            per_mag.append({"spikes": [len(r["monitor"]["spikes"]) for r in rs],
                            "nonfinite_steps": [len(r["monitor"]["nonfinite_steps"])
                                                for r in rs],
                            "max_grad_norm": [r["monitor"]["max_grad_norm"] for r in rs],
                            "diverged": [r["monitor"]["diverged"] for r in rs]})
        monitor[name] = per_mag
    return {"magnitudes": [float(m) for m in config.magnitudes], "seeds": list(cfg.seed_list),
            "units": units, "gaps": gaps, "monitor": monitor, "steps": cfg.steps,
            "model_size": cfg.model_size, "units_folder": str(folder),
            "wall_seconds": time.perf_counter() - t0}


def summarize(results: dict[str, Any]) -> str:
    """Gaps per magnitude and the monitor's counts."""
    mags = results["magnitudes"]
    rows = [[k] + [stats.format_gap(stats.Gap.from_dict(g)) for g in gs]
            for k, gs in results["gaps"].items()]
    out = [format_table(["paired gap", *[f"{m:g}" for m in mags]], rows,
                        title=(f"token-gradient outliers (1/256 of tokens), {results['steps']} "
                               f"steps, {results['model_size']} model, seeds "
                               f"{results['seeds']}"))]
    rows = []
    for name, per in results["monitor"].items():
        for m, p in zip(mags, per):
            rows.append([name, f"{m:g}", "/".join(map(str, p["spikes"])),
                         "/".join(map(str, p["nonfinite_steps"])),
                         "/".join(f"{v:.3g}" for v in p["max_grad_norm"]),
                         "/".join("yes" if d else "no" for d in p["diverged"])])
    out.append(format_table(["setup", "magnitude", "loss spikes", "non-finite steps",
                             "max grad norm", "diverged"], rows,
                            title="divergence monitor, per seed"))
    out += ["loss spike: a loss above 1.1x the median of the 20 steps before it; non-finite "
            "steps: steps with an inf/NaN gradient element or loss.", stats.PAIRED_NOTE]
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``grad_blocks_monitor.png``: per magnitude (columns), the loss and the gradient norm
    per step (seed 0) of each setup, spikes marked; ``grad_blocks_gaps.png``: the paired
    gaps with ±3 SE whiskers."""
    mags = results["magnitudes"]
    with plot_style():
        fig, axes = figure(2, len(mags), width=4.0 * len(mags), height=6.0)
        axes = np.asarray(axes).reshape(2, len(mags))
        for j, m in enumerate(mags):
            for name, u in results["units"].items():
                r = next(r for r in u["runs"] if r["grad_magnitude"] == m)
                h = r["history"]
                x = np.arange(len(h["loss"]))
                (line,) = axes[0, j].plot(x, h["loss"], lw=0.8, label=name)
                sp = r["monitor"]["spikes"]
                if sp:
                    axes[0, j].plot(sp, np.asarray(h["loss"])[sp], "x",
                                    color=line.get_color())
                axes[1, j].plot(x, h["grad_norm"], lw=0.8, label=name)
            axes[0, j].set_title(f"gradient outliers {m:g}x")
            axes[1, j].set_yscale("log")
            axes[1, j].set_xlabel("step")
        axes[0, 0].set_ylabel("loss (x: spike)")
        axes[1, 0].set_ylabel("gradient norm (before clipping)")
        axes[0, 0].legend(fontsize=7)
        paths = [save(fig, out_dir, "grad_blocks_monitor")]
    gaps = {f"{k} @ {m:g}": stats.Gap.from_dict(g) for k, gs in results["gaps"].items()
            for m, g in zip(mags, gs)}
    paths.append(stats.plot_gap_bars(gaps, out_dir, "grad_blocks_gaps",
                                     title="final-loss gaps (paired, ±3 SE)"))
    return paths
