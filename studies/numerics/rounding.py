"""Study ``rounding``: how fp16 and bf16 round values across the range.

For each value and format, ``fmtkit.decompose`` gives the stored bits (sign, exponent,
mantissa), the stored value, its kind (normal / subnormal / zero / inf, with overflow or
underflow marked) and the relative error. fp16 has 3 more mantissa bits (unit roundoff 2^-11
vs 2^-8), so it is more precise inside its range; bf16 has float32's 8 exponent bits, so
70000 (above fp16's 65504) and 1e-30 (below fp16's 6e-8) survive in bf16 only.

A sweep over magnitudes plots each format's worst relative error per log-spaced bin.

    fmtkit study rounding [--values 0.1 12.345 70000 1e-30] [--formats fp16 bf16 e4m3]
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from fmtkit.casting import cast
from fmtkit.formats import decompose, get_format
from studies.lib.common import FORMAT_COLORS, figure, format_table, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "rounding"
SUMMARY = "fp16 vs bf16 rounding across the range: stored bits, errors, overflow"
ORDER = 50

__all__ = ["Config", "plot", "run", "summarize"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``rounding`` study.

    Attributes:
      values: the values to store (any finite numbers).
      formats: format names or aliases to compare.
      sweep_bins: number of log-spaced magnitude bins in the error sweep (0: no sweep).
      points_per_bin: values per bin (the bin's worst relative error is reported).
      sweep_min: smallest magnitude of the sweep (>= 2^-126: float32 normal numbers).
      sweep_max: largest magnitude of the sweep.
    """

    values: tuple[float, ...] = (0.1, 12.345, 70000.0, 1e-30)
    formats: tuple[str, ...] = ("fp16", "bf16")
    sweep_bins: int = 150
    points_per_bin: int = 32
    sweep_min: float = 1e-37
    sweep_max: float = 1e38

    def __post_init__(self):
        if not self.values or not all(math.isfinite(v) for v in self.values):
            raise ValueError(f"values must be finite numbers, got {self.values!r}.")
        if isinstance(self.formats, str) or not self.formats:
            raise ValueError(f"formats must be a non-empty tuple of names, got "
                             f"{self.formats!r}.")
        for f in self.formats:
            get_format(f)  # ValueError listing the valid names
        if self.sweep_bins < 0:
            raise ValueError(f"sweep_bins must be >= 0, got {self.sweep_bins}.")
        if self.points_per_bin < 1:
            raise ValueError(f"points_per_bin must be >= 1, got {self.points_per_bin}.")
        # The sweep casts float32 inputs; XLA on CPU flushes float32 subnormals.
        if not 2.0**-126 <= self.sweep_min < self.sweep_max <= 3.4e38:
            raise ValueError("need 2^-126 <= sweep_min < sweep_max <= 3.4e38, got "
                             f"sweep_min={self.sweep_min}, sweep_max={self.sweep_max}.")


def run(config: Config) -> dict[str, Any]:
    """One record per (value, format) from ``fmtkit.decompose``, plus the error sweep.

    Example:
      >>> r = run(Config(values=(0.1,), formats=("fp16",), sweep_bins=0))
      >>> r["rows"][0]["stored"], r["rows"][0]["bits"]
      (0.0999755859375, '0 01011 1001100110')
    """
    fmts = [get_format(f) for f in dict.fromkeys(config.formats)]
    rows = []
    for v in config.values:
        for f in fmts:
            d = decompose(v, f)
            rows.append({"value": d.value, "format": d.format, "bits": d.bits,
                         "stored": d.stored, "kind": d.kind, "abs_error": d.abs_error,
                         "rel_error": d.rel_error})
    sweep: dict[str, Any] = {}
    if config.sweep_bins:
        nb, k = config.sweep_bins, config.points_per_bin
        edges = np.geomspace(config.sweep_min, config.sweep_max, nb + 1)
        x32 = np.geomspace(config.sweep_min, config.sweep_max, nb * k,
                           endpoint=False).astype(np.float32)
        xt = x32.astype(np.float64)
        sweep = {"bin_lo": edges[:-1].tolist(), "bin_hi": edges[1:].tolist(), "errors": {}}
        for f in fmts:
            y = np.asarray(cast(jnp.asarray(x32), f).astype(jnp.float32), np.float64)
            with np.errstate(invalid="ignore"):
                err = np.where(np.isfinite(y), np.abs(y - xt) / xt, np.inf)
            sweep["errors"][f.name] = err.reshape(nb, k).max(axis=1).tolist()
    limits = {f.name: {"max": f.max, "min_subnormal": f.min_subnormal,
                       "min_normal": f.min_normal, "unit_roundoff": f.eps / 2}
              for f in fmts}
    return {"rows": rows, "formats": limits, "sweep": sweep}


def _err(e: float) -> str:
    return "inf" if math.isinf(e) else f"{e:.2e}"


def summarize(results: dict[str, Any]) -> str:
    """One line per (value, format): bits, stored value, kind, relative error."""
    rows = [[f"{r['value']:.6g}", r["format"], r["bits"], f"{r['stored']:.8g}", r["kind"],
             _err(r["rel_error"])] for r in results["rows"]]
    return format_table(["value", "format", "sign exponent mantissa", "stored", "kind",
                         "rel error"], rows, title="Rounding to each format (nearest even)")


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``rounding.png``: worst relative error per magnitude bin, per format."""
    sw = results["sweep"]
    if not sw:
        return []
    with plot_style():
        fig, ax = figure(width=7.0, height=4.2)
        lo, hi = np.asarray(sw["bin_lo"]), np.asarray(sw["bin_hi"])
        g = np.sqrt(lo * hi)
        for name, errs in sw["errors"].items():
            color = FORMAT_COLORS.get(name)
            e = np.asarray(errs, np.float64)
            line, = ax.loglog(g, np.where(np.isfinite(e), e, np.nan), color=color,
                              label=f"{name} (unit roundoff "
                                    f"2^{math.log2(results['formats'][name]['unit_roundoff']):.0f})")
            over = results["formats"][name]["max"]
            if over < hi[-1]:
                ax.axvspan(over, hi[-1], color=line.get_color(), alpha=0.08)
                ax.text(over * 2, 1.3, f"{name} overflows", fontsize=7, va="bottom",
                        color=line.get_color())
        for r in results["rows"]:
            if r["value"] != 0:
                ax.axvline(abs(r["value"]), color="k", lw=0.5, alpha=0.4)
        ax.set_xlim(lo[0], hi[-1])
        ax.set_ylim(1e-5, 3.0)
        ax.set_xlabel("|x|")
        ax.set_ylabel("worst relative error in the bin (1 = flushed to 0)")
        ax.set_title("Rounding error across the range (vertical lines: the table's values)")
        ax.legend(loc="lower left")
        return [save(fig, out_dir, "rounding")]
