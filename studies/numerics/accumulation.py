"""Study ``accumulation``: an FP8 GEMM with a limited-precision accumulator, with and without
promotion into float32 every 128 elements of K.

Hopper's FP8 tensor cores accumulate with "around 14 bits" of precision (DeepSeek-V3, arXiv
2412.19437, section 3.3.2), where float32 keeps 24 significant bits. DeepSeek's fix: every
N_C = 128 elements of the contraction, add the partial sum into a float32 register on the
CUDA cores and restart it (promotion). This study emulates both with
``fmtkit.fp8.limited_precision_matmul``:

    products a_k * b_k are exact in f32 (E4M3 x E4M3 needs 2 x 4 = 8 significant bits)
    acc = trunc_m(fl32(acc + a_k * b_k))          after every addition (m mantissa bits,
                                                  rounded toward zero: the register width)
    promoted: every 128 k, f32_total += acc; acc = 0

and measures ``||C - C_ref||_F / ||C_ref||_F`` (and the largest elementwise relative error)
against the float64 product of the same FP8 operands, as K grows, for

* ``limited``: one limited-precision accumulator over the whole K (no promotion);
* ``promoted``: the same accumulator promoted into f32 every ``promote_every`` elements;
* ``f32``: XLA's float32 dot of the same operands (the usual reference accumulator).

Two operand distributions: ``positive`` (|N(0, 1)| cast to E4M3: every partial sum grows, so
truncation toward zero is a bias that adds up, about K/2 half-ulps) and ``gaussian`` (N(0, 1):
the partial sums random-walk and the truncation errors partly cancel). The default 13
explicit mantissa bits are 14 significant bits with the implicit leading one. The
same draw is used for every K (the first K columns), so the curves are comparable.

Expected (positive data, no promotion): once the running sum S_k is large, each addition
loses on average half an ulp of it, and an ulp of S is between 2^-(m+1) S and 2^-m S
depending on where S sits in its binade; the sum of S_k is about K S_K / 2, so the relative
error of the total tends to between 2^-(m+2) K / 2 and 2^-(m+1) K / 2: 6% to 12% at
K = 4096 with m = 13 (less at small K, where the exact partial sums still fit in m + 1
significant bits). With promotion the error stays at its K = 128 level whatever K is: the
chunks' errors are independent and relative to their own sums. DeepSeek-V3 reports "nearly
2%" maximum relative error for K = 4096 on its hardware test (data not given).
The ``max_rel_error`` columns divide by ``|A| |B|^T`` elementwise (``|C|`` itself for
positive data).

    fmtkit study accumulation [--ks 128 256 ... 4096] [--mantissa-bits 13] [--data positive]
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.casting import cast
from fmtkit.formats import get_format
from fmtkit.fp8 import limited_precision_matmul
from studies.lib.common import figure, format_table, no_progress, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "accumulation"
SUMMARY = "FP8 GEMM with a ~14-bit accumulator vs K, with/without promotion every 128"
ORDER = 90

__all__ = ["DATA", "VARIANTS", "Config", "make_operands", "plot", "run", "summarize"]

DATA = ("positive", "gaussian")
VARIANTS = ("limited", "promoted", "f32")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``accumulation`` study.

    Attributes:
      m: rows of A (the output is m x n).
      n: rows of B.
      ks: contraction sizes (each a multiple of promote_every); the first K columns of one
        draw of max(ks) columns.
      mantissa_bits: explicit mantissa bits of the emulated accumulator (13: Hopper's
        "around 14 bits" of precision with the implicit bit; f32 has 23).
      promote_every: promotion interval N_C (DeepSeek-V3: 128).
      bits_sweep: accumulator mantissa bits swept at the largest K (empty: skip).
      data: operand distributions ("positive": |N(0,1)|, "gaussian": N(0,1)).
      fmt: the operands' FP8 format (values are cast to it unscaled; N(0,1) fits E4M3).
      seed: seed of the draw.
    """

    m: int = 64
    n: int = 64
    ks: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    mantissa_bits: int = 13
    promote_every: int = 128
    bits_sweep: tuple[int, ...] = (10, 11, 12, 13, 14, 16, 18, 23)
    data: tuple[str, ...] = DATA
    fmt: str = "e4m3"
    seed: int = 0

    def __post_init__(self):
        for name in ("m", "n", "promote_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if not self.ks or not all(isinstance(k, int) and k > 0 and k % self.promote_every == 0
                                  for k in self.ks):
            raise ValueError(f"ks must be positive multiples of promote_every="
                             f"{self.promote_every}, got {self.ks!r}.")
        for b in (self.mantissa_bits, *self.bits_sweep):
            if not isinstance(b, int) or not 1 <= b <= 23:
                raise ValueError(f"mantissa_bits and bits_sweep must be ints in [1, 23], got "
                                 f"{b!r}.")
        if not self.data or any(d not in DATA for d in self.data):
            raise ValueError(f"data must be a non-empty subset of {DATA}, got {self.data!r}.")
        if get_format(self.fmt).bits > 8:
            raise ValueError(f"fmt must be an 8-bit-or-narrower format, got {self.fmt!r}.")


def make_operands(config: Config, data: str) -> tuple[np.ndarray, np.ndarray]:
    """The FP8 operands as float32 arrays: A [m, max(ks)] and B [n, max(ks)].

    Values are drawn as f32 N(0, 1) (``|.|`` for "positive") and cast to ``config.fmt`` with
    round-to-nearest-even (values beyond the format's max would saturate; N(0,1) stays far
    below E4M3's 448).
    """
    if data not in DATA:
        raise ValueError(f"data must be one of {DATA}, got {data!r}.")
    k = max(config.ks)
    ka, kb = jax.random.split(jax.random.key(config.seed))
    a = jax.random.normal(ka, (config.m, k), jnp.float32)
    b = jax.random.normal(kb, (config.n, k), jnp.float32)
    if data == "positive":
        a, b = jnp.abs(a), jnp.abs(b)
    fmt = get_format(config.fmt)
    a = cast(a, fmt, overflow="saturate").astype(jnp.float32)
    b = cast(b, fmt, overflow="saturate").astype(jnp.float32)
    return np.asarray(a), np.asarray(b)


@functools.partial(jax.jit, static_argnames=("mantissa_bits", "promote_every"))
def _limited(a, b, *, mantissa_bits, promote_every):
    return limited_precision_matmul(a, b, mantissa_bits=mantissa_bits,
                                    promote_every=promote_every)


@jax.jit
def _f32_dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def _errors(out: np.ndarray, ref: np.ndarray, abs_ref: np.ndarray) -> tuple[float, float]:
    """(normwise relative error, largest elementwise error relative to |A| |B|^T), float64.

    The elementwise figure divides by ``sum_k |a_ik| |b_jk|`` (the usual denominator of
    dot-product error bounds), which is ``|C_ij|`` itself for positive operands and does not
    blow up where a Gaussian product happens to be near zero.
    """
    err = np.asarray(out, np.float64) - ref
    norm = float(np.linalg.norm(err) / np.linalg.norm(ref))
    nz = abs_ref != 0
    elem = float(np.max(np.abs(err[nz]) / abs_ref[nz])) if nz.any() else 0.0
    return norm, elem


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Relative errors per data set, variant and K, and over accumulator widths at max(ks).

    Returns:
      ``{"ks": [...], "data": {name: {"curves": {variant: {"rel_error": [...],
      "max_rel_error": [...]}}, "bits_sweep": {"bits": [...], "limited": [...],
      "promoted": [...]}, "ratio_at_max_k": limited / promoted}}, ...}``.
    """
    ks = sorted(config.ks)
    kmax = ks[-1]
    bits, pe = config.mantissa_bits, config.promote_every
    out: dict[str, Any] = {"ks": ks, "mantissa_bits": bits, "promote_every": pe,
                           "m": config.m, "n": config.n, "format": get_format(config.fmt).name,
                           "data": {}}
    jobs = [(d, k) for d in config.data for k in ks]
    curves = {d: {v: {"rel_error": [], "max_rel_error": []} for v in VARIANTS}
              for d in config.data}
    operands = {d: make_operands(config, d) for d in config.data}
    for d, k in progress(jobs, total=len(jobs), desc="K"):
        a, b = operands[d][0][:, :k], operands[d][1][:, :k]
        ref = a.astype(np.float64) @ b.astype(np.float64).T
        abs_ref = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64).T
        results = {
            "limited": _limited(a, b, mantissa_bits=bits, promote_every=None),
            "promoted": _limited(a, b, mantissa_bits=bits, promote_every=pe),
            "f32": _f32_dot(a, b),
        }
        for v, res in results.items():
            norm, elem = _errors(np.asarray(res), ref, abs_ref)
            curves[d][v]["rel_error"].append(norm)
            curves[d][v]["max_rel_error"].append(elem)
    for d in config.data:
        a, b = operands[d][0][:, :kmax], operands[d][1][:, :kmax]
        ref = a.astype(np.float64) @ b.astype(np.float64).T
        sweep: dict[str, list] = {"bits": list(config.bits_sweep), "limited": [], "promoted": []}
        for mb in config.bits_sweep:
            for v, p in (("limited", None), ("promoted", pe)):
                res = _limited(a, b, mantissa_bits=mb, promote_every=p)
                sweep[v].append(_errors(np.asarray(res), ref, ref)[0])
        c = curves[d]
        out["data"][d] = {
            "curves": c,
            "bits_sweep": sweep,
            "ratio_at_max_k": (c["limited"]["rel_error"][-1]
                               / max(c["promoted"]["rel_error"][-1], 1e-300)),
            # Half an ulp lost per addition over K additions (module docstring): the range the
            # positive-data error tends to at large K.
            "bias_estimate_at_max_k": [2.0 ** -(bits + 2) * kmax / 2,
                                       2.0 ** -(bits + 1) * kmax / 2],
        }
    return out


def summarize(results: dict[str, Any]) -> str:
    """Relative error per K, variant and data set."""
    parts = []
    for d, rec in results["data"].items():
        c = rec["curves"]
        rows = [[k] + [f"{100 * c[v]['rel_error'][i]:.3g}%" for v in VARIANTS]
                + [f"{100 * c['limited']['max_rel_error'][i]:.3g}%"]
                for i, k in enumerate(results["ks"])]
        parts.append(format_table(
            ["K", "limited", f"promoted/{results['promote_every']}", "f32 dot",
             "limited: max elem"], rows,
            title=(f"{d} {results['format']} operands, {results['m']}x{results['n']} output, "
                   f"{results['mantissa_bits']}-bit accumulator: ||C - C64|| / ||C64||  "
                   f"(limited / promoted at K={results['ks'][-1]}: "
                   f"{rec['ratio_at_max_k']:.1f}x)")))
    return "\n\n".join(parts)


_STYLE = {"limited": ("no promotion", "#d62728", "o"),
          "promoted": ("promoted every {pe}", "#2ca02c", "s"),
          "f32": ("f32 dot (XLA)", "#1f77b4", "^")}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``accumulation.png``: error vs K (one panel per data set) and vs accumulator bits."""
    datasets = list(results["data"])
    with plot_style():
        fig, axes = figure(1, len(datasets) + 1, width=4.2 * (len(datasets) + 1), height=3.8)
        axes = np.atleast_1d(axes)
        for ax, d in zip(axes, datasets):
            for v, rec in results["data"][d]["curves"].items():
                label, color, marker = _STYLE[v]
                ys = [max(e, 1e-12) for e in rec["rel_error"]]
                ax.plot(results["ks"], ys, marker=marker, color=color,
                        label=label.format(pe=results["promote_every"]))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("K (contraction length)")
            ax.set_ylabel("||C - C_f64|| / ||C_f64||")
            ax.set_title(f"{d} operands, {results['mantissa_bits']}-bit accumulator")
            ax.legend()
        ax = axes[-1]
        kmax = results["ks"][-1]
        for d in datasets:
            sw = results["data"][d]["bits_sweep"]
            for v, ls in (("limited", "-"), ("promoted", "--")):
                ax.plot(sw["bits"], [max(e, 1e-12) for e in sw[v]], ls=ls, marker=".",
                        label=f"{d}, {_STYLE[v][0].format(pe=results['promote_every'])}")
        ax.set_yscale("log")
        ax.set_xlabel("accumulator mantissa bits")
        ax.set_ylabel("relative error")
        ax.set_title(f"K = {kmax}")
        ax.legend(fontsize=7)
        return [save(fig, out_dir, "accumulation")]
