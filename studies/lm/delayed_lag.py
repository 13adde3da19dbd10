"""Study ``delayed-lag``: delayed scaling's lag behind an emerging outlier, measured per step.

DeepSeek-V3 computes its FP8 scales online, per tile, "rather than only from the
historical maximum" (arXiv 2412.19437, sec. 3.3.1); Transformer Engine's delayed scaling
takes a per-tensor scale from the largest amax of the last ``history`` steps (default
1024). This study makes an outlier channel *emerge* during training: one channel of the
blocks' normalized inputs grows geometrically from 1x to ``magnitude`` over ``ramp_steps``
steps from ``ramp_start`` (``studies.training.fp8_training.Ramp``: the rows that read it stay at
zero, so only the quantizers see it), and trains bf16-mixed, fp8-current (per tensor,
scale from this step's amax) and fp8-delayed with histories 1, 16 and 1024, seeds paired.

Per step, on the first block's attention input (``studies.training.fp8_training``): ``saturated``
(elements above the amax the delayed scale was taken from: E4M3 clips them to 448),
``amax`` vs ``amax_used`` and the SQNR of the channels other than the outlier under that
scale. Per setup: overflow events (steps with a saturated element), saturated elements in
all, and the final-loss gap to fp8-current and to bf16-mixed (paired, ``*`` beyond 3 SE).

What to expect: while the outlier grows, every step's amax exceeds every earlier one, so
each delayed history saturates on each step of the ramp, whatever its length; after it,
history 1 follows the batch-to-batch variation of the amax and keeps saturating on about
every other step, while long histories keep the largest amax seen and stop. Saturation
clips the outlier channel itself, whose readers are zero here, so it costs the loss little;
what the normal channels lose is the SQNR column.

    fmtkit study delayed-lag [--magnitude 1e4] [--ramp-start 30] [--ramp-steps 40]
                             [--histories 1 16 1024] [--steps 120] [--seeds 3]
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fmtkit.fp8 import RECIPES
from studies.lib import stats
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.training import fp8_training as ft
from studies.training.config import TrainConfig
from studies.training.data import load_data
from studies.training.setups import get_setup

# How the command line lists this study (studies.app.registry).
NAME = "delayed-lag"
SUMMARY = "delayed scaling (history 1/16/1024) vs current as an outlier emerges"
ORDER = 160

__all__ = ["Config", "plot", "run", "setups", "summarize"]

REFERENCE = "fp8-current"


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``delayed-lag`` study.

    Attributes:
      magnitude: the outlier channel's final magnitude (default 1e4, as in
        ``fmtkit study fp8-outliers``).
      ramp_start: the step at which the outlier starts to grow.
      ramp_steps: steps over which it grows geometrically from 1x to ``magnitude``.
      histories: amax-history lengths of the delayed setups.
      d_model: the model's width (multiple of 128).
      parallel: setups trained at once (threads).
      resume: a units folder of an earlier run (units found there are reused).
      work_dir: where a new run's units folder goes.
      train: the training settings.
    """

    magnitude: float = 1e4
    ramp_start: int = 30
    ramp_steps: int = 40
    histories: tuple[int, ...] = (1, 16, 1024)
    d_model: int = 256
    parallel: int = 2
    resume: str | None = None
    work_dir: str = "runs/units"
    train: TrainConfig = TrainConfig(steps=120, seeds=3)

    def __post_init__(self):
        if not (isinstance(self.magnitude, (int, float)) and math.isfinite(self.magnitude)
                and self.magnitude >= 1):
            raise ValueError(f"magnitude must be a finite number >= 1, got {self.magnitude!r}.")
        ft.Ramp(self.ramp_start, self.ramp_steps)  # validates both
        if not self.histories or not all(isinstance(h, int) and not isinstance(h, bool)
                                         and h >= 1 for h in self.histories):
            raise ValueError(f"histories must be ints >= 1, got {self.histories!r}.")
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or \
                self.d_model < 128 or self.d_model % 128:
            raise ValueError(f"d_model must be a multiple of 128, got {self.d_model!r}.")
        ft.check_parallel(self.parallel)
        ft.check_resume(self.resume)


def setups(histories: tuple[int, ...]) -> dict[str, Any]:
    """bf16-mixed, fp8-current and one delayed setup per history length, by name."""
    out = {"bf16-mixed": get_setup("bf16-mixed"), "fp8-current": get_setup("fp8-current")}
    for h in histories:
        recipe = dataclasses.replace(RECIPES["delayed"], history=h)
        out[f"fp8-delayed-h{h}"] = ft.fp8_setup(f"fp8-delayed-h{h}", recipe)
    return out


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains every setup on the ramped outlier, every seed.

    Returns:
      ``{"units": {setup: unit}, "events": {setup: per seed {"overflow_steps",
      "saturated_total", "during_ramp", "after_ramp"}}, "gaps_vs_current", "gaps_vs_bf16",
      "ramp", "magnitude", "seeds", ...}``.
    """
    t0 = time.perf_counter()
    cfg = ft.replace_model(config.train, ft.wide_model(config.train.seq_len, config.d_model,
                                                       2 * config.d_model))
    data = load_data(cfg)
    ramp = ft.Ramp(config.ramp_start, config.ramp_steps)
    runs = tuple(ft.Run(s, float(config.magnitude)) for s in cfg.seed_list)
    folder = ft.units_folder(config.resume, config.work_dir, "delayed-lag")
    named = setups(config.histories)

    def train(name):
        return ft.train_unit(named[name], cfg, runs, outliers=True, ramp=ramp,
                             progress=progress, data=data, cache=folder, study="delayed-lag")

    with ThreadPoolExecutor(config.parallel) as pool:
        units = dict(zip(named, pool.map(train, named)))
    # The steps whose magnitude exceeds the previous step's: start + 1 .. start + steps.
    grow = slice(config.ramp_start + 1, config.ramp_start + config.ramp_steps + 1)
    events = {}
    for name, u in units.items():
        per = []
        for r in u["runs"]:
            sat = np.asarray(r["history"]["saturated"])
            per.append({"overflow_steps": int(np.sum(sat > 0)),
                        "saturated_total": int(np.sum(sat)),
                        "during_ramp": int(np.sum(sat[grow] > 0)),
                        "after_ramp": int(np.sum(sat[grow.stop:] > 0))})
        events[name] = per
    cur = ft.final_losses(units[REFERENCE])
    bf = ft.final_losses(units["bf16-mixed"])
    return {
        "units": units, "events": events,
        "gaps_vs_current": {n: stats.compare(cur, ft.final_losses(u), paired=True).to_dict()
                            for n, u in units.items() if n not in (REFERENCE, "bf16-mixed")},
        "gaps_vs_bf16": {n: stats.compare(bf, ft.final_losses(u), paired=True).to_dict()
                         for n, u in units.items() if n != "bf16-mixed"},
        "ramp": {"start": config.ramp_start, "steps": config.ramp_steps},
        "magnitude": float(config.magnitude), "seeds": list(cfg.seed_list),
        "steps": cfg.steps, "units_folder": str(folder), "d_model": config.d_model,
        "wall_seconds": time.perf_counter() - t0,
    }


def summarize(results: dict[str, Any]) -> str:
    """Overflow events, saturated elements and loss gaps per setup."""
    rows = []
    for name, per in results["events"].items():
        if name == "bf16-mixed":
            continue
        u = results["units"][name]
        sq = np.mean([np.mean(r["history"]["sqnr_normal"][results["ramp"]["start"]:])
                      for r in u["runs"]])
        g_cur = results["gaps_vs_current"].get(name)
        rows.append([
            name,
            "/".join(str(p["overflow_steps"]) for p in per),
            "/".join(str(p["during_ramp"]) for p in per),
            "/".join(str(p["after_ramp"]) for p in per),
            "/".join(str(p["saturated_total"]) for p in per),
            f"{sq:.1f}",
            "-" if g_cur is None else stats.format_gap(stats.Gap.from_dict(g_cur)),
            stats.format_gap(stats.Gap.from_dict(results["gaps_vs_bf16"][name])),
        ])
    r = results["ramp"]
    return "\n".join([format_table(
        ["setup", "overflow steps", "in ramp", "after", "saturated elems", "SQNR normal dB",
         "vs fp8-current", "vs bf16-mixed"], rows,
        title=(f"outlier ramp 1x -> {results['magnitude']:g}x over steps {r['start']}.."
               f"{r['start'] + r['steps']} of {results['steps']} (block 0 attention input; "
               f"per seed {results['seeds']})")),
        "overflow steps: steps with an element above the amax the scale came from (E4M3 "
        "clips it to 448); SQNR normal: the non-outlier channels under that scale, mean "
        "from the ramp's start.", stats.PAIRED_NOTE])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``delayed_lag.png``: per step (seed 0) the amax used over the current amax, the
    saturated elements and the normal channels' SQNR, one line per setup."""
    r = results["ramp"]
    with plot_style():
        fig, axes = figure(3, 1, width=7.5, height=8.0)
        for name, u in results["units"].items():
            if name == "bf16-mixed":
                continue
            h = u["runs"][0]["history"]
            x = np.arange(len(h["loss"]))
            ratio = np.asarray(h["amax_used"]) / np.asarray(h["amax"])
            axes[0].plot(x, ratio, label=name, lw=1)
            axes[1].plot(x, h["saturated"], label=name, lw=1)
            axes[2].plot(x, h["sqnr_normal"], label=name, lw=1)
        for ax in axes:
            ax.axvspan(r["start"], r["start"] + r["steps"], color="0.9")
        axes[0].set_yscale("log")
        axes[0].set_ylabel("amax used / current amax")
        axes[1].set_ylabel("saturated elements")
        axes[2].set_ylabel("SQNR normal channels (dB)")
        axes[2].set_xlabel("step (grey: the outlier grows)")
        axes[0].set_title(f"emerging outlier to {results['magnitude']:g}x, seed "
                          f"{results['seeds'][0]}")
        axes[0].legend(fontsize=7)
        return [save(fig, out_dir, "delayed_lag")]
