"""Study ``formats``: the range/precision table of every format, and its dynamic range.

For each format: bit layout, largest finite value, smallest normal and subnormal values,
machine epsilon (spacing above 1.0), decimal digits of precision (``(m + 1) log10 2``) and the
dynamic range in binades (powers of two) from the smallest subnormal to the largest value.
The numbers come from ``fmtkit.FORMATS``, which derives them from each format's bit layout and
is cross-checked against ``ml_dtypes.finfo`` in the tests.

The plot draws each format's range on a log2 axis: normal numbers dark, subnormals light.

    fmtkit study formats [--formats fp16 bf16 e4m3]
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from fmtkit.formats import FORMATS, get_format
from studies.lib.common import FORMAT_COLORS, figure, format_table, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "formats"
SUMMARY = "range/precision table of every format and a dynamic-range plot"
ORDER = 10

__all__ = ["Config", "plot", "run", "summarize"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``formats`` study.

    Attributes:
      formats: format names or aliases to include (default: all of ``fmtkit.FORMATS``).
    """

    formats: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.formats, str):
            raise TypeError(f"formats must be a tuple of names, got the str {self.formats!r}.")
        for f in self.formats:
            get_format(f)  # ValueError listing the valid names


def run(config: Config) -> dict[str, Any]:
    """The table as a list of rows (one dict per format), in ``FORMATS`` order.

    Example:
      >>> run(Config(formats=("fp16",)))["formats"][0]["max"]
      65504.0
    """
    names = [get_format(f).name for f in config.formats] or list(FORMATS)
    rows = []
    for name in dict.fromkeys(names):  # keep order, drop duplicates
        f = FORMATS[name]
        rows.append({
            "name": f.name,
            "bits": f.bits,
            "storage_bytes": f.storage_bytes,
            "exponent_bits": f.exponent_bits,
            "mantissa_bits": f.mantissa_bits,
            "bias": f.bias,
            "max": f.max,
            "min_normal": f.min_normal,
            "min_subnormal": f.min_subnormal,
            "eps": f.eps,
            "log2_max": math.log2(f.max),
            "log2_min_normal": math.log2(f.min_normal),
            "log2_min_subnormal": math.log2(f.min_subnormal),
            "decimal_digits": (f.mantissa_bits + 1) * math.log10(2.0),
            "binades": math.log2(f.max / f.min_subnormal),
            "normal_binades": math.log2(f.max / f.min_normal),
            "has_inf": f.has_inf,
            "has_nan": f.has_nan,
            "has_negative_zero": f.has_negative_zero,
        })
    return {"formats": rows}


def summarize(results: dict[str, Any]) -> str:
    """The range/precision table."""
    rows = [[r["name"], f"{r['exponent_bits']}/{r['mantissa_bits']}", r["bias"],
             f"{r['max']:.4g}", f"{r['min_normal']:.4g}", f"{r['min_subnormal']:.4g}",
             f"{r['eps']:.3g}", f"{r['decimal_digits']:.2f}", f"{r['binades']:.1f}",
             "y" if r["has_inf"] else "-"]
            for r in results["formats"]]
    return format_table(
        ["format", "E/M", "bias", "max", "min normal", "min subnormal", "eps", "digits",
         "binades", "inf"], rows, title="Range and precision of each format")


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``dynamic_range.png``: each format's range on a log2 axis."""
    rows = results["formats"]
    with plot_style():
        fig, ax = figure(width=7.5, height=0.35 * len(rows) + 1.2)
        for i, r in enumerate(rows):
            color = FORMAT_COLORS.get(r["name"], "#7f7f7f")
            lo, mid, hi = r["log2_min_subnormal"], r["log2_min_normal"], r["log2_max"]
            if mid > lo:
                ax.barh(i, mid - lo, left=lo, color=color, alpha=0.35, height=0.6)
            ax.barh(i, hi - mid, left=mid, color=color, height=0.6)
            ax.text(hi + 2, i, f"{r['max']:.3g}  ({r['mantissa_bits']} mantissa bits)",
                    va="center", fontsize=7)
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
        ax.invert_yaxis()
        ax.axvline(0.0, color="k", lw=0.6)
        ax.set_xlabel("log2 |x|   (light: subnormals, dark: normal numbers)")
        ax.set_title("Dynamic range per format, smallest subnormal to largest finite value")
        xmax = max(r["log2_max"] for r in rows)
        ax.set_xlim(min(r["log2_min_subnormal"] for r in rows) - 4, xmax + 0.35 * (xmax + 150))
        return [save(fig, out_dir, "dynamic_range")]
