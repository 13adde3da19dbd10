"""Study ``fp8-outliers``: FP8 scaling granularity vs outlier channels.

A [rows, cols] standard-normal activation whose first ``outlier_channels`` columns are
multiplied by an outlier factor (LLM activations have a few such channels) is quantized to
E4M3 and back with four recipes:

* ``tensor``: one scale for the whole tensor (``TensorScaling``);
* ``row``: one scale per row (``AxisScaling(-1)``: per token; every row holds an outlier);
* ``block``: one scale per 1x128 tile (``BlockScaling((1, 128))``, DeepSeek-V3's activations);
* ``mx``: one E8M0 power-of-two scale per 1x32 tile (``MXScaling(32)``, OCP MX v1.0).

Scale = amax / 448 (E4M3's max, OCP FP8 v1.0). The error is measured on the *normal* channels
outside the outliers' first block (columns ``block:``), ``||qdq(x) - x|| / ||x||`` there: with
one scale for everything, a large outlier pushes the normal values into E4M3's subnormals
(below 2^-6 after scaling) or to zero; with blocks, only the outliers' own block suffers.

Seed reference (torch, one 256x1024 draw): per-tensor 2.6% / 4.9% / 14.1% at outliers
1e2 / 1e4 / 3e4, per 1x128 block a flat 2.6%.

    fmtkit study fp8-outliers [--outliers 1e2 1e3 1e4 3e4] [--rows 256 --cols 1024]
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp

from fmtkit.formats import get_format
from fmtkit.scaling import AxisScaling, BlockScaling, MXScaling, TensorScaling, qdq
from fmtkit.telemetry import compare
from studies.lib.common import figure, format_table, no_progress, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "fp8-outliers"
SUMMARY = "per-tensor vs row vs 1x128 block vs MX scaling as outlier channels grow"
ORDER = 60

__all__ = ["RECIPES", "Config", "make_tensor", "plot", "recipes", "run", "summarize"]

RECIPES = ("tensor", "row", "block", "mx")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``fp8-outliers`` study.

    Attributes:
      outliers: outlier factors (the outlier columns are multiplied by each).
      rows: rows of the activation (tokens).
      cols: columns (channels); a multiple of ``block`` and ``mx_block``.
      outlier_channels: how many leading columns carry the outliers (<= block).
      block: width of the 1 x block tiles.
      mx_block: width of the MX blocks (32 in OCP MX v1.0).
      mx_rounding: MX scale rule (floor is the OCP spec's).
      fmt: the FP8 element format.
      seed: seed of the normal draw (the same draw for every outlier factor).
    """

    outliers: tuple[float, ...] = (1e2, 3e2, 1e3, 3e3, 1e4, 3e4)
    rows: int = 256
    cols: int = 1024
    outlier_channels: int = 4
    block: int = 128
    mx_block: int = 32
    mx_rounding: Literal["floor", "ceil", "even", "rceil"] = "floor"
    fmt: str = "e4m3"
    seed: int = 0

    def __post_init__(self):
        if not self.outliers or not all(math.isfinite(o) and o > 0 for o in self.outliers):
            raise ValueError(f"outliers must be positive finite numbers, got "
                             f"{self.outliers!r}.")
        for name in ("rows", "cols", "block", "mx_block", "outlier_channels"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if self.cols % self.block or self.cols % self.mx_block or self.cols <= self.block:
            raise ValueError(f"cols={self.cols} must be a multiple of block={self.block} and "
                             f"mx_block={self.mx_block}, and larger than block.")
        if self.outlier_channels > self.block:
            raise ValueError(f"outlier_channels={self.outlier_channels} must be <= "
                             f"block={self.block} (the normal channels start at block).")
        MXScaling(self.mx_block, self.mx_rounding)  # validates mx_rounding
        if get_format(self.fmt).bits > 8:
            raise ValueError(f"fmt must be an 8-bit-or-narrower format, got {self.fmt!r}.")


def recipes(config: Config) -> dict[str, Any]:
    """The four scaling recipes of the study, by name."""
    return {
        "tensor": TensorScaling(),
        "row": AxisScaling(-1),
        "block": BlockScaling((1, config.block)),
        "mx": MXScaling(config.mx_block, config.mx_rounding),
    }


def make_tensor(config: Config, outlier: float) -> jax.Array:
    """The f32 [rows, cols] standard normal draw with its first columns times ``outlier``."""
    x = jax.random.normal(jax.random.key(config.seed), (config.rows, config.cols), jnp.float32)
    factor = jnp.where(jnp.arange(config.cols) < config.outlier_channels,
                       jnp.float32(outlier), jnp.float32(1.0))
    return x * factor[None, :]


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Relative error, SQNR and flush-to-zero fraction on the normal channels, per recipe.

    Returns:
      ``{"outliers": [...], "recipes": {name: {"rel_error": [...], "sqnr_db": [...],
      "underflow": [...]}}, ...}``, lists aligned with ``outliers``.
    """
    fmt = get_format(config.fmt)
    recs = recipes(config)

    @jax.jit
    def measure(x):
        normal = x[:, config.block:]
        out = {}
        for name, r in recs.items():
            stats = compare(normal, qdq(x, fmt, r)[:, config.block:])
            out[name] = (stats.rel_error, stats.sqnr_db, stats.underflow_share)
        return out

    per = {name: {"rel_error": [], "sqnr_db": [], "underflow": []} for name in recs}
    for outlier in progress(config.outliers, total=len(config.outliers), desc="outliers"):
        stats = jax.device_get(measure(make_tensor(config, outlier)))
        for name, (rel, sqnr, under) in stats.items():
            per[name]["rel_error"].append(float(rel))
            per[name]["sqnr_db"].append(float(sqnr))
            per[name]["underflow"].append(float(under))
    return {
        "outliers": list(config.outliers),
        "format": fmt.name,
        "format_max": fmt.max,
        "recipes": per,
        "seed_reference": {"outliers": [1e2, 1e4, 3e4], "tensor": [0.026, 0.049, 0.141],
                           "block": [0.026, 0.026, 0.026]},
    }


def summarize(results: dict[str, Any]) -> str:
    """Relative error on the normal channels per outlier factor and recipe."""
    per = results["recipes"]
    rows = []
    for i, o in enumerate(results["outliers"]):
        rows.append([f"{o:g}"] + [f"{100 * per[n]['rel_error'][i]:.2f}%" for n in per]
                    + [f"{100 * per['tensor']['underflow'][i]:.1f}%"])
    return format_table(
        ["outlier", *[f"{n} err" for n in per], "tensor: flushed"], rows,
        title=f"{results['format']}: relative error on the normal channels "
              "(tensor / row / 1x128 block / MX 1x32 scaling)")


_STYLE = {"tensor": ("per tensor", "#d62728", "o"), "row": ("per row", "#ff7f0e", "v"),
          "block": ("per 1x128 block", "#2ca02c", "s"), "mx": ("MX 1x32 (E8M0)", "#1f77b4", "^")}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fp8_outliers.png``: relative error on the normal channels vs outlier size (log x)."""
    with plot_style():
        fig, ax = figure(width=6.4, height=4.2)
        x = results["outliers"]
        for name, rec in results["recipes"].items():
            label, color, marker = _STYLE.get(name, (name, None, "."))
            ax.plot(x, [100 * e for e in rec["rel_error"]], marker=marker, color=color,
                    label=label, ls="--" if name == "row" else "-")
        ref = results["seed_reference"]
        ax.plot(ref["outliers"], [100 * e for e in ref["tensor"]], "x", color="k",
                label="seed (torch): per tensor")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("outlier factor of the first channels")
        ax.set_ylabel("relative error on the normal channels (%)")
        ax.set_title(f"{results['format']} quantization: one scale vs fine-grained scales")
        ax.legend()
        return [save(fig, out_dir, "fp8_outliers")]
