"""Study ``fp8-long``: fp8-blockwise vs bf16-mixed over a longer run on real text, against
DeepSeek-V3's 0.25% line.

DeepSeek-V3 (arXiv 2412.19437, sec. 3.3 and App. B.1) reports that its fine-grained FP8
recipe (1x128 activation and gradient tiles, 128x128 weight blocks) stays within 0.25%
relative loss of BF16 on runs of ~1T tokens. This study trains the "small" model (4 blocks
of d_model 256) on the Python standard library's text (``--data stdlib``) for 1000 steps
under bf16-mixed and fp8-blockwise, seeds paired (seed k of both shares its initial
parameters and batches; ``studies.training.multiseed``), and plots the relative gap
``(L_fp8 - L_bf16) / L_bf16`` per step (50-step moving average, mean ± std over seeds)
against ±0.25%. Also reported: the final-loss gap (last 10% of the steps, paired, ``*``
beyond 3 SE) and the held-out bits per byte. Checkpoints every ``--checkpoint-every``
steps; ``--resume`` continues from them.

The control (``--control fp32`` by default) is the noise floor the FP8 gap is read against:
the same seeds trained in float32, its gap to bf16-mixed computed and plotted the same way.
Paired runs share parameters and batches, but training amplifies any change of rounding
until the trajectories decorrelate; a gap no wider than BF16's own gap to FP32 says FP8
changed the run no more than BF16 rounding does. ``--control none`` skips it.

    fmtkit study fp8-long [--steps 1000] [--seeds 3] [--model-size small] [--data stdlib]
                          [--control fp32] [--checkpoint-every 250]
                          [--resume CHECKPOINT_FOLDER]
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from studies.lib import corpus, stats
from studies.lib.common import format_table, no_progress
from studies.training import fp8_training as ft
from studies.training import multiseed, setups
from studies.training.config import TrainConfig
from studies.training.data import load_data

# How the command line lists this study (studies.app.registry).
NAME = "fp8-long"
SUMMARY = "fp8-blockwise vs bf16-mixed over 1000+ steps of stdlib text vs the 0.25% bar"
ORDER = 180

__all__ = ["BAR", "Config", "plot", "relative_gap_curve", "run", "summarize"]

BAR = 0.0025
"""DeepSeek-V3's bound on FP8's relative loss gap to BF16 (0.25%)."""

SETUPS = ("bf16-mixed", "fp8-blockwise")
SMOOTH = 50
"""Steps of the moving average of the plotted gap: the per-step gap of a batch-8 loss
swings by ~1%, four times the bar; 50 steps bring the noise of the mean below it."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``fp8-long`` study.

    Attributes:
      checkpoint_dir: checkpoints go to CHECKPOINT_DIR/<timestamp>/<setup>/.
      resume: an earlier run's checkpoint folder (CHECKPOINT_DIR/<timestamp>): every
        setup continues from its latest checkpoint.
      parallel: setups trained at once (threads).
      control: a setup of ``studies.training.setups`` whose gap to bf16-mixed is the noise
        floor (plotted beside the FP8 gap), or ``"none"``.
      train: the training settings (small model, 1000 steps, stdlib text by default).
    """

    checkpoint_dir: str = "runs/fp8-long-checkpoints"
    resume: str | None = None
    parallel: int = 2
    control: str = "fp32"
    train: TrainConfig = TrainConfig(model_size="small", steps=1000, seeds=3, data="stdlib",
                                     checkpoint_every=250, warmup=50)

    def __post_init__(self):
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r}: no such folder (give the checkpoint "
                             "folder of an earlier fp8-long run).")
        ft.check_parallel(self.parallel)
        allowed = [n for n in setups.SETUPS if n not in SETUPS] + ["none"]
        if self.control not in allowed:
            raise ValueError(f"control must be one of {allowed}, got {self.control!r}.")

    @property
    def setups(self) -> tuple[str, ...]:
        """The reference, fp8-blockwise and the control (if any), in that order."""
        return SETUPS if self.control == "none" else (*SETUPS, self.control)


def relative_gap_curve(ref: list[list[float]], cand: list[list[float]],
                       smooth: int = 1) -> np.ndarray:
    """Per seed, ``(cand - ref) / mean over seeds of ref`` per step after a trailing
    ``smooth``-step moving average of both curves: [seeds, steps - smooth + 1]."""
    a = np.asarray(ref, np.float64)
    b = np.asarray(cand, np.float64)
    n = min(a.shape[1], b.shape[1])
    a, b = a[:, :n], b[:, :n]
    smooth = min(smooth, n)  # a run shorter than the window: one average over all of it
    if smooth > 1:
        k = np.ones(smooth) / smooth
        a = np.stack([np.convolve(r, k, mode="valid") for r in a])
        b = np.stack([np.convolve(r, k, mode="valid") for r in b])
    return (b - a) / a.mean(axis=0)


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains the setups, every seed; the curves, the final gaps (fp8-blockwise's at the top
    level, the control's under ``control_gap``) and the held-out loss."""
    t0 = time.perf_counter()
    cfg = config.train
    data = load_data(cfg)
    params = multiseed.seed_params(cfg)
    root = Path(config.resume) if config.resume else (
        Path(config.checkpoint_dir) / time.strftime("%Y%m%d-%H%M%S")
        if cfg.checkpoint_every > 0 else None)

    def train(name):
        t = time.perf_counter()
        res = multiseed.train_seeds(name, cfg, progress,
                                    run_dir=None if root is None else root / name,
                                    resume=config.resume is not None, data=data, params=params)
        row = res.summary()
        row["wall_seconds"] = time.perf_counter() - t
        return row

    with ThreadPoolExecutor(config.parallel) as pool:
        rows = dict(zip(config.setups, pool.map(train, config.setups)))
    curves = multiseed.seed_curves(list(rows.values()))
    smooth = min(SMOOTH, cfg.steps)
    ref = SETUPS[0]

    def versus(name):
        gap = relative_gap_curve(curves[ref], curves[name], smooth)
        mean = gap.mean(axis=0)
        return {"final_gap": stats.compare(rows[ref]["final_loss"], rows[name]["final_loss"],
                                           paired=True).to_dict(),
                "gap_curve_mean": mean.tolist(),
                "gap_curve_std": (gap.std(axis=0, ddof=1).tolist() if gap.shape[0] > 1
                                  else [0.0] * len(mean)),
                "share_within_bar": float(np.mean(np.abs(mean) <= BAR))}

    control = None if config.control == "none" else config.control
    return {
        "rows": rows, "seeds": list(cfg.seed_list), "steps": cfg.steps,
        "model_size": cfg.model_size, "data": cfg.data, **versus(SETUPS[1]),
        "control": control, "control_gap": None if control is None else versus(control),
        "smooth": smooth, "bar": BAR,
        "heldout_bits_per_byte": {n: [None if p["heldout_loss"] is None else
                                      corpus.bits_per_byte(p["heldout_loss"])
                                      for p in r["per_seed"]] for n, r in rows.items()},
        "checkpoint_dir": None if root is None else str(root),
        "wall_seconds": time.perf_counter() - t0,
    }


def summarize(results: dict[str, Any]) -> str:
    """Final losses, the final gap and the share of steps within the bar."""
    rows = []
    for n, r in results["rows"].items():
        held = results["heldout_bits_per_byte"][n]
        rows.append([n, stats.format_mean_std(r["final_loss"]),
                     "-" if None in held else stats.format_mean_std(held),
                     f"{r['step_ms']:.0f}", f"{r['wall_seconds']:.0f}"])
    g = stats.Gap.from_dict(results["final_gap"])
    lines = [
        format_table(["setup", "final loss", "held-out bpb", "ms/step (all seeds)", "s"],
                     rows, title=(f"{results['steps']} steps, {results['model_size']} model, "
                                  f"data {results['data']}, seeds {results['seeds']}")),
        f"fp8-blockwise vs bf16-mixed, final loss (paired): {stats.format_gap(g)}; "
        f"DeepSeek-V3's bar: |gap| < {100 * results['bar']:g}%.",
        f"{results['smooth']}-step averaged gap within ±{100 * results['bar']:g}% on "
        f"{100 * results['share_within_bar']:.0f}% of the steps."]
    c = results.get("control_gap")
    if c is not None:
        cg = stats.Gap.from_dict(c["final_gap"])
        lines.append(
            f"noise floor, {results['control']} vs bf16-mixed (paired): {stats.format_gap(cg)}; "
            f"within ±{100 * results['bar']:g}% on {100 * c['share_within_bar']:.0f}% of the "
            f"steps. Std of one seed's final gap: fp8-blockwise "
            f"{100 * g.relative_std:.2f}%, {results['control']} {100 * cg.relative_std:.2f}%.")
    return "\n".join([*lines, stats.PAIRED_NOTE])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fp8_long_gap.png``: the relative gaps per step (moving average, mean ± std over
    seeds) of fp8-blockwise and of the control with the ±0.25% lines;
    ``fp8_long_loss.png``: the loss curves."""
    from studies.lib.common import figure, plot_style, save

    curves = [("fp8-blockwise vs bf16-mixed", "#2ca02c", results)]
    if results.get("control_gap") is not None:
        curves.append((f"{results['control']} vs bf16-mixed (noise floor)", "#7f7f7f",
                       results["control_gap"]))
    with plot_style():
        fig, ax = figure(width=7.0, height=4.0)
        for label, color, r in curves:
            mean = 100 * np.asarray(r["gap_curve_mean"])
            std = 100 * np.asarray(r["gap_curve_std"])
            x = np.arange(len(mean)) + results["smooth"] - 1
            ax.plot(x, mean, color=color, label=label)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2)
        for s in (1, -1):
            ax.axhline(s * 100 * results["bar"], color="k", ls="--", lw=0.8)
        ax.axhline(0, color="k", lw=0.5, ls=":")
        ax.set_xlabel("step")
        ax.set_ylabel("relative loss gap (%)")
        ax.set_title(f"{results['smooth']}-step average, mean ± std over seeds "
                     f"{results['seeds']}; dashed: DeepSeek-V3's ±0.25%")
        ax.legend(fontsize=7)
        paths = [save(fig, out_dir, "fp8_long_gap")]
    paths.append(stats.plot_seed_bands(multiseed.seed_curves(list(results["rows"].values())),
                                       out_dir, "fp8_long_loss", smooth=20,
                                       title="training loss, mean ± std over seeds"))
    return paths
