"""Study ``outlier-dose``: loss gap to bf16-mixed vs activation-outlier magnitude, per FP8
recipe: DeepSeek-V3's "per-tensor breaks as outliers grow, fine-grained stays flat" in training.

Trains the one-block LM at d_model 256 (``studies.training.fp8_training.wide_model``: two 1x128
tiles per row, so the 1x128 tile holding the outlier channel is not the one holding the
other half of the channels) under bf16-mixed and the FP8 setups fp8-current, fp8-delayed
(per tensor), fp8-rowwise, fp8-blockwise (1x128) and fp8-mxfp8 (1x32, E8M0), each at
every outlier magnitude (default 1e2, 1e3, 1e4, 3e4, 1e5: the 1e2, 1e4 and 3e4 of
``fmtkit study fp8-outliers`` and [Sun24]'s largest massive activations) and seed. The
outlier is one channel of the blocks' normalized inputs, with the rows that read it held at zero
(``studies.training.fp8_training``): bf16-mixed computes the same function at every magnitude
(bf16 scales each element on its own), so one bf16-mixed run per seed is the reference of
every magnitude, and any gap is the FP8 quantizers'. Seed k of every setup starts from the
same parameters and sees the same batches; the gaps are paired per seed
(``studies.lib.stats.compare(paired=True)``, ``*`` beyond 3 SE), and per-tensor minus blockwise
is reported per magnitude too.

Beside the losses, the mechanism: the first block's attention input (seed 0's initial
parameters, one batch, each magnitude) quantized per tensor, per row, per 1x128 tile and
per MX block: the SQNR (dB) of the 1x128 tile that does not hold the outlier.

    fmtkit study outlier-dose [--magnitudes 1e2 1e3 1e4 3e4 1e5] [--seeds 3] [--steps 100]
                              [--resume UNITS_FOLDER]
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fmtkit
from fmtkit import fp8, qdq
from fmtkit.telemetry import compare
from studies.lib import regimes, stats
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lib.models import TransformerLM
from studies.training import fp8_training as ft
from studies.training.config import TrainConfig
from studies.training.data import batch_at, load_data
from studies.training.setups import get_setup
from studies.training.step import init_params

# How the command line lists this study (studies.app.registry).
NAME = "outlier-dose"
SUMMARY = "FP8 recipes' loss gap to bf16 vs activation-outlier magnitude (1e2..1e5)"
ORDER = 140

__all__ = ["REFERENCE", "SETUPS", "Config", "gemm_input", "plot", "run", "significant_from",
           "summarize", "tile_sqnr"]

REFERENCE = "bf16-mixed"
SETUPS = ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "fp8-mxfp8")
"""The FP8 setups (``studies.training.setups``), per tensor first."""

PER_TENSOR = ("fp8-current", "fp8-delayed")
FINE = "fp8-blockwise"

TILE = 128
"""The 1x128 tile of DeepSeek-V3's activations (``fmtkit.fp8.RECIPES["blockwise"]``)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``outlier-dose`` study.

    Attributes:
      magnitudes: outlier magnitudes (at least 1 each).
      setups: the FP8 setups trained at every magnitude (bf16-mixed is the reference).
      d_model: the model's width (a multiple of 128, at least 256: the outlier channel's
        1x128 tile must leave another tile).
      parallel: units (setups) trained at once, each in its own thread (2 fill a 2-core
        machine; results do not depend on it).
      resume: a units folder of an earlier run: units found there are not trained again.
      work_dir: where a new run's units folder goes.
      train: the training settings (steps, batch, seq_len, lr, seeds, data).
    """

    magnitudes: tuple[float, ...] = (1e2, 1e3, 1e4, 3e4, 1e5)
    setups: tuple[str, ...] = SETUPS
    d_model: int = 256
    parallel: int = 2
    resume: str | None = None
    work_dir: str = "runs/units"
    train: TrainConfig = TrainConfig(steps=100, seeds=3)

    def __post_init__(self):
        ft.check_magnitudes(self.magnitudes)
        for s in self.setups:
            if not s.startswith("fp8-"):
                raise ValueError(f"setups must be FP8 setups (fp8-*), got {s!r}.")
            get_setup(s)
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or \
                self.d_model < 2 * TILE or self.d_model % TILE:
            raise ValueError(f"d_model must be a multiple of {TILE} and >= {2 * TILE}, got "
                             f"{self.d_model!r}.")
        ft.check_parallel(self.parallel)
        ft.check_resume(self.resume)

    def train_config(self) -> TrainConfig:
        """``train`` on ``wide_model(seq_len, d_model)``."""
        return ft.replace_model(self.train, ft.wide_model(self.train.seq_len, self.d_model,
                                                          2 * self.d_model))


def gemm_input(cfg: TrainConfig, magnitude: float, *, seed: int = 0, step: int = 0,
               params: Any = None) -> np.ndarray:
    """The first block's attention input [tokens, d_model] (f32; ``ln_1``'s output with the
    outlier channel at ``magnitude``) of ``params`` (default: seed's initial ones, readers
    masked) on the batch of ``step``, as the bf16-mixed model computes it."""
    d = cfg.model_config().d_model
    if params is None:
        params = init_params(cfg.with_seed(seed))
        mask = fmtkit_mask(params, d)
        params = jax.tree.map(lambda x, m: x * m, params, mask)
    params = ft.with_outlier(params, magnitude, ft.outlier_channel(d), d)
    model = fmtkit.with_policy(TransformerLM(cfg.model_config()), get_setup(REFERENCE).rules())
    tokens = jnp.asarray(batch_at(load_data(cfg), cfg.with_seed(seed), step))
    _, inter = model.apply({"params": params}, tokens, mutable=["intermediates"],
                           capture_intermediates=lambda mdl, name: mdl.name == "ln_1")
    (y,) = inter["intermediates"]["Block_0"]["ln_1"]["__call__"]
    return np.asarray(jnp.asarray(y, jnp.float32).reshape(-1, d))


def fmtkit_mask(params: Any, d_model: int) -> Any:
    """The outlier regime's reader mask of ``params`` (``OutlierFeatures.reader_mask``)."""
    return regimes.OutlierFeatures().reader_mask(params, d_model)


def tile_sqnr(x: np.ndarray, channel: int) -> dict[str, dict[str, float]]:
    """SQNR (dB) of each 1x128 column tile of ``x`` [tokens, d] (``"outlier"``: the tile
    holding ``channel``; ``"other"``: the mean over the others) after E4M3 quantization
    under each FP8 setup's activation scaling (``Fp8Recipe.scaling("x")``)."""
    xj = jnp.asarray(x, jnp.float32)
    d = x.shape[1]
    t_out = channel // TILE
    out = {}
    for name in SETUPS:
        recipe = fp8.get_recipe(name.removeprefix("fp8-"))
        q = qdq(xj, recipe.x_format, recipe.scaling("x"))
        per = [float(compare(xj[:, t * TILE:(t + 1) * TILE],
                             q[:, t * TILE:(t + 1) * TILE]).sqnr_db) for t in range(d // TILE)]
        others = [v for t, v in enumerate(per) if t != t_out]
        out[name] = {"outlier": per[t_out], "other": float(np.mean(others))}
    return out


def _gap(ref: list[float], cand: list[float]) -> dict[str, Any]:
    return stats.compare(ref, cand, paired=True).to_dict()


def significant_from(results: dict[str, Any], setup: str) -> float | None:
    """The smallest magnitude from which on every larger one ``setup``'s gap to bf16-mixed
    is significant and positive (None: not at the largest)."""
    mags = results["magnitudes"]
    found = None
    for i in reversed(range(len(mags))):
        g = results["gaps"][setup][i]
        if g["significant"] and g["gap"] > 0:
            found = mags[i]
        else:
            break
    return found


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains bf16-mixed (once per seed) and each FP8 setup at every magnitude and seed.

    Returns:
      ``{"magnitudes", "seeds", "reference": unit, "units": {setup: unit}, "gaps": {setup:
      [paired gap dict per magnitude]}, "per_tensor_vs_fine": {setup: [gap per
      magnitude]}, "tile_sqnr": [per magnitude: tile_sqnr], "channel", "units_folder",
      "model", "wall_seconds"}`` (units: ``studies.training.fp8_training.train_unit``).
    """
    import time

    t0 = time.perf_counter()
    cfg = config.train_config()
    data = load_data(cfg)
    seeds = cfg.seed_list
    folder = ft.units_folder(config.resume, config.work_dir, "outlier-dose")
    jobs = [(REFERENCE, tuple(ft.Run(s) for s in seeds))]
    jobs += [(name, tuple(ft.Run(s, float(m)) for m in config.magnitudes for s in seeds))
             for name in config.setups]

    def train(job):
        name, runs = job
        return ft.train_unit(get_setup(name), cfg, runs, outliers=True, progress=progress,
                             data=data, cache=folder, study="outlier-dose")

    with ThreadPoolExecutor(config.parallel) as pool:
        done = dict(zip([n for n, _ in jobs], pool.map(train, jobs)))
    ref = ft.final_losses(done[REFERENCE])
    gaps = {n: [_gap(ref, ft.final_losses(done[n], magnitude=float(m)))
                for m in config.magnitudes] for n in config.setups}
    vs_fine = {}
    if FINE in config.setups:
        for n in PER_TENSOR:
            if n in config.setups:
                vs_fine[n] = [_gap(ft.final_losses(done[FINE], magnitude=float(m)),
                                   ft.final_losses(done[n], magnitude=float(m)))
                              for m in config.magnitudes]
    d = cfg.model_config().d_model
    ch = ft.outlier_channel(d)
    sq = [tile_sqnr(gemm_input(cfg, float(m), seed=seeds[0]), ch) for m in config.magnitudes]
    mcfg = cfg.model_config()
    return {
        "magnitudes": [float(m) for m in config.magnitudes], "seeds": list(seeds),
        "reference": done[REFERENCE], "units": {n: done[n] for n in config.setups},
        "gaps": gaps, "per_tensor_vs_fine": vs_fine, "tile_sqnr": sq, "channel": ch,
        "units_folder": str(folder),
        "model": {"d_model": mcfg.d_model, "num_layers": mcfg.num_layers, "d_ff": mcfg.d_ff},
        "train": {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                  "lr": cfg.lr, "data": cfg.data},
        "wall_seconds": time.perf_counter() - t0,
    }


def summarize(results: dict[str, Any]) -> str:
    """Gap to bf16-mixed per setup and magnitude; per-tensor minus blockwise; tile SQNR."""
    mags = results["magnitudes"]
    rows = [[n] + [stats.format_gap(stats.Gap.from_dict(g)) for g in gs]
            for n, gs in results["gaps"].items()]
    rows += [[f"{n} - fp8-blockwise"] + [stats.format_gap(stats.Gap.from_dict(g)) for g in gs]
             for n, gs in results["per_tensor_vs_fine"].items()]
    m = results["model"]
    t = results["train"]
    out = [format_table(
        ["setup", *[f"{v:g}" for v in mags]], rows,
        title=(f"final-loss gap to bf16-mixed vs outlier magnitude (d_model {m['d_model']}, "
               f"{t['steps']} steps of {t['batch']}x{t['seq_len']}, seeds {results['seeds']}, "
               "paired)"))]
    sq = results["tile_sqnr"]
    rows = [[n] + [f"{s[n]['other']:.1f} / {s[n]['outlier']:.1f}" for s in sq]
            for n in sq[0]]
    out.append(format_table(
        ["x quantization", *[f"{v:g}" for v in mags]], rows,
        title=("SQNR (dB) of the first block's attention input, seed 0 at init: the 1x128 tile "
               f"without / with the outlier channel {results['channel']}")))
    for n in results["gaps"]:
        f = significant_from(results, n)
        out.append(f"{n}: gap significant (> 3 SE, positive) from magnitude "
                   f"{'-' if f is None else format(f, 'g')} on.")
    out.append(stats.PAIRED_NOTE)
    return "\n".join(out)


_COLORS = {"fp8-current": "#d62728", "fp8-delayed": "#9467bd", "fp8-rowwise": "#ff7f0e",
           "fp8-blockwise": "#2ca02c", "fp8-mxfp8": "#1f77b4"}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``outlier_dose.png``: left, the paired gap to bf16-mixed (%) vs magnitude per setup,
    mean ± std over seeds (band); right, the SQNR of the tile without the outlier."""
    mags = np.asarray(results["magnitudes"])
    with plot_style():
        fig, (ax, bx) = figure(1, 2, width=11.0, height=4.2)
        for n, gs in results["gaps"].items():
            mean = np.array([100 * stats.Gap.from_dict(g).relative for g in gs])
            ref_mean = np.array([stats.Gap.from_dict(g).reference.mean for g in gs])
            std = np.array([100 * stats.Gap.from_dict(g).std for g in gs]) / ref_mean
            ax.plot(mags, mean, marker="o", color=_COLORS.get(n), label=n)
            ax.fill_between(mags, mean - std, mean + std, color=_COLORS.get(n), alpha=0.15)
        ax.axhline(0.0, color="k", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("outlier magnitude")
        ax.set_ylabel("final-loss gap to bf16-mixed (%)")
        ax.set_title("loss gap, mean ± std of the per-seed gap")
        ax.legend(fontsize=7)
        for n in results["tile_sqnr"][0]:
            bx.plot(mags, [s[n]["other"] for s in results["tile_sqnr"]], marker="o",
                    color=_COLORS.get(n), label=n)
        bx.set_xscale("log")
        bx.set_xlabel("outlier magnitude")
        bx.set_ylabel("SQNR of the normal 1x128 tile (dB)")
        bx.set_title("GEMM input (block 0 attention), E4M3")
        bx.legend(fontsize=7)
        return [save(fig, out_dir, "outlier_dose")]
