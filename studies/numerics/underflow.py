"""Study ``underflow``: small gradients in fp16 directly, with loss scaling, and in bf16.

Each gradient ``g`` (float32) is stored three ways:

* fp16 directly: ``cast(g, fp16)``; below half of fp16's smallest subnormal (2^-25, about
  2.98e-8) it flushes to 0, and below 2^-14 (6.1e-5) it keeps fewer than 11 significant bits;
* fp16 with loss scaling: ``cast(g * S, fp16)`` then ``* (1 / S)`` in float32 (S = 2^16, the
  PyTorch GradScaler default): the scale moves the value into fp16's normal range;
* bf16: ``cast(g, bf16)``: float32's exponent range, so nothing underflows, but 8 significant
  bits (relative error up to 2^-8).

A sweep over magnitudes shows the worst relative error of each path in each of
``sweep_bins`` log-spaced bins (``points_per_bin`` log-spaced values each): the error envelope
(unit roundoff 2^-11 for fp16 normals, 2^-8 for bf16, 1 where a value flushes to zero).

    fmtkit study underflow [--grads 1e-8 5e-8 3e-7 1e-5 2e-2] [--scale 65536]
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from fmtkit.casting import cast
from fmtkit.formats import get_format
from studies.lib.common import FORMAT_COLORS, figure, format_table, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "underflow"
SUMMARY = "small gradients in fp16 directly, with loss scaling (x2^16), and in bf16"
ORDER = 20

__all__ = ["Config", "plot", "run", "summarize"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``underflow`` study.

    Attributes:
      grads: gradient values (positive) to store in each format.
      scale: the loss scale S (multiplied before the fp16 cast, divided after, in float32).
      sweep_bins: number of log-spaced magnitude bins in the error sweep (0: no sweep).
      points_per_bin: values per bin (the bin's worst relative error is reported).
      sweep_min: smallest magnitude of the sweep.
      sweep_max: largest magnitude of the sweep.
    """

    grads: tuple[float, ...] = (1e-8, 5e-8, 3e-7, 1e-5, 2e-2)
    scale: float = 2.0**16
    sweep_bins: int = 150
    points_per_bin: int = 32
    sweep_min: float = 1e-10
    sweep_max: float = 1e5

    def __post_init__(self):
        if not self.grads or not all(math.isfinite(g) and g > 0 for g in self.grads):
            raise ValueError(f"grads must be positive finite numbers, got {self.grads!r}.")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}.")
        if not math.isfinite(float(np.float32(self.scale))):
            raise ValueError(f"scale={self.scale} overflows float32.")
        if self.sweep_bins < 0:
            raise ValueError(f"sweep_bins must be >= 0, got {self.sweep_bins}.")
        if self.points_per_bin < 1:
            raise ValueError(f"points_per_bin must be >= 1, got {self.points_per_bin}.")
        if not 0 < self.sweep_min < self.sweep_max < 3e38:
            raise ValueError("need 0 < sweep_min < sweep_max < 3e38, got "
                             f"sweep_min={self.sweep_min}, sweep_max={self.sweep_max}.")


def _paths(g32: np.ndarray, scale: float) -> dict[str, np.ndarray]:
    """The stored value of each float32 gradient along the three paths, as float64."""
    x = jnp.asarray(g32, jnp.float32)
    s = jnp.float32(scale)
    direct = cast(x, "fp16")
    scaled = cast(x * s, "fp16")
    restored = scaled.astype(jnp.float32) * (jnp.float32(1.0) / s)
    return {
        "fp16": np.asarray(direct, np.float64),
        "fp16_scaled": np.asarray(scaled, np.float64),  # still multiplied by S
        "fp16_loss_scaled": np.asarray(restored, np.float64),
        "bf16": np.asarray(cast(x, "bf16").astype(jnp.float32), np.float64),
    }


def _rel_err(stored: np.ndarray, true: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(stored), np.abs(stored - true) / true, np.inf)


def run(config: Config) -> dict[str, Any]:
    """Stored values, flushes and relative errors of each gradient along each path.

    Returns:
      ``{"rows": [...], "sweep": {...}, "fp16_min_subnormal": ..., "scale": ...}``; each row has
      the float32 gradient, the stored value of each path (``fp16``, ``fp16_scaled`` =
      ``cast(g * S)``, ``fp16_loss_scaled`` = restored, ``bf16``), its relative error and
      whether it flushed to zero.
    """
    g32 = np.asarray(config.grads, np.float32)
    true = g32.astype(np.float64)
    paths = _paths(g32, config.scale)
    rows = []
    for i, g in enumerate(true):
        row: dict[str, Any] = {"grad": float(g)}
        for k, v in paths.items():
            row[k] = float(v[i])
        for k in ("fp16", "fp16_loss_scaled", "bf16"):
            row[f"{k}_rel_err"] = float(_rel_err(paths[k][i], g))
            row[f"{k}_flushed"] = bool(paths[k][i] == 0.0)
        rows.append(row)

    sweep: dict[str, Any] = {}
    if config.sweep_bins:
        nb, k = config.sweep_bins, config.points_per_bin
        edges = np.geomspace(config.sweep_min, config.sweep_max, nb + 1)
        s32 = np.geomspace(config.sweep_min, config.sweep_max, nb * k,
                           endpoint=False).astype(np.float32)
        st = s32.astype(np.float64)
        sp = _paths(s32, config.scale)
        sweep = {"bin_lo": edges[:-1].tolist(), "bin_hi": edges[1:].tolist()}
        for name in ("fp16", "fp16_loss_scaled", "bf16"):
            sweep[name] = _rel_err(sp[name], st).reshape(nb, k).max(axis=1).tolist()
    f16 = get_format("fp16")
    # Values from max + ulp(max) / 2 up round to inf (IEEE 754 round to nearest even).
    f16_overflow = f16.max + 2.0 ** (math.floor(math.log2(f16.max)) - f16.mantissa_bits - 1)
    return {
        "scale": config.scale,
        "fp16_min_subnormal": f16.min_subnormal,
        "fp16_min_normal": f16.min_normal,
        "fp16_max": f16.max,
        "fp16_overflow_from": f16_overflow,
        # Loss scaling moves fp16's window down by S: what now flushes and what overflows.
        "scaled_flush_below": f16.min_subnormal / 2 / config.scale,
        "scaled_overflow_from": f16_overflow / config.scale,
        "rows": rows,
        "sweep": sweep,
    }


def _pct(e: float) -> str:
    return "inf" if math.isinf(e) else f"{100 * e:.3g}%"


def summarize(results: dict[str, Any]) -> str:
    """One line per gradient: stored value and relative error along each path."""
    rows = [[f"{r['grad']:.3g}", f"{r['fp16']:.4g}", _pct(r["fp16_rel_err"]),
             f"{r['fp16_scaled']:.4g}", f"{r['fp16_loss_scaled']:.4g}",
             _pct(r["fp16_loss_scaled_rel_err"]), f"{r['bf16']:.4g}", _pct(r["bf16_rel_err"])]
            for r in results["rows"]]
    s = results["scale"]
    table = format_table(
        ["grad", "fp16", "err", f"x{s:g} in fp16", "unscaled", "err", "bf16", "err"], rows,
        title=f"Gradients stored in fp16, in fp16 with loss scale {s:g}, and in bf16")
    return (f"{table}\nfp16 flushes |g| < {results['fp16_min_subnormal'] / 2:.3g}; with scale "
            f"{s:g} it flushes |g| < {results['scaled_flush_below']:.3g} and overflows "
            f"|g| >= {results['scaled_overflow_from']:.6g}.")


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``underflow.png``: worst relative error vs gradient magnitude for each path."""
    sw = results["sweep"]
    if not sw:
        return []
    with plot_style():
        fig, ax = figure(width=7.0, height=4.2)
        lo, hi = np.asarray(sw["bin_lo"]), np.asarray(sw["bin_hi"])
        g = np.sqrt(lo * hi)
        styles = {
            "fp16": ("fp16 directly", FORMAT_COLORS["float16"], "-"),
            "fp16_loss_scaled": (f"fp16, loss scale {results['scale']:g}", "#8c564b", "--"),
            "bf16": ("bf16", FORMAT_COLORS["bfloat16"], "-"),
        }
        for k, (label, color, ls) in styles.items():
            e = np.asarray(sw[k], np.float64)
            e = np.where(np.isfinite(e), e, np.nan)  # overflow (inf): shaded instead
            ax.loglog(g, e, ls, color=color, label=label)
        for r in results["rows"]:
            ax.axvline(r["grad"], color="k", lw=0.5, alpha=0.4)
        top = hi[-1]
        if results["fp16_overflow_from"] < top:
            ax.axvspan(results["fp16_overflow_from"], top, color=FORMAT_COLORS["float16"],
                       alpha=0.12, label="fp16 overflows (inf)")
        if results["scaled_overflow_from"] < top:
            ax.axvspan(results["scaled_overflow_from"], top, color="#8c564b", alpha=0.08,
                       label="scaled fp16 overflows (inf)")
        ax.set_xlim(lo[0], top)
        ax.set_ylim(1e-5, 2.0)
        ax.set_xlabel("gradient magnitude |g|")
        ax.set_ylabel("worst relative error in the bin (1 = flushed to 0)")
        ax.set_title("Small gradients: fp16 underflows, loss scaling recovers them, bf16 "
                     "never underflows\n(vertical lines: the table's gradients)")
        ax.legend(loc="lower left")
        return [save(fig, out_dir, "underflow")]
