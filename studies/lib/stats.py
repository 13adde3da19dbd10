"""Several seeds per setup: mean ± std, the gap of two setups and whether it is significant.

A training study that runs each setup once cannot tell a precision effect from run-to-run
noise: a single-seed ``fmtkit ablate`` can end every setup within 0.1% of fp32, inside the
spread between seeds. This module is the statistics the studies and ``fmtkit
ablate`` put in their tables and plots. Everything here is pure NumPy on per-seed numbers
(e.g. each seed's final loss); nothing trains.

The rule (``compare``)
----------------------
For a reference setup A (e.g. fp32) and a candidate B, with per-seed values a_1..a_n and
b_1..b_m::

    gap  = mean(b) - mean(a)                              (positive: B ends worse)
    s_a, s_b = sample standard deviations (ddof = 1)
    SE   = sqrt(s_a^2 / n + s_b^2 / m)                    (Welch: seeds independent)
    significant  <=>  |gap| > 3 * SE                      (and n, m >= 2)

SE is the standard error of the difference of two independent means (Welch 1947), so the
rule does not assume equal variances. The factor 3 is a fixed, conservative bar rather than
a p-value threshold because there are few seeds: with 3 seeds per setup Welch's
t-statistic has between 2 and 4 degrees of freedom (Welch-Satterthwaite), and
P(|t| > 3) is 0.040 at 4 and 0.095 at 2 degrees of freedom (two-sided; ``Gap.p_value``
reports the exact value) - about a 1-in-25 to 1-in-10 false alarm per comparison under the
null, versus 0.27% for a normal z-score. More seeds tighten it towards the normal value.

Seeds are treated as independent, as the rule says, even though the training studies start
every setup of seed k from the same initial parameters and batches. That pairing usually
makes the runs of one seed positively correlated, so the independent SE is larger than the
SE of the paired differences: the rule is conservative for paired runs. ``paired=True``
uses the paired SE instead (``std(b_i - a_i) / sqrt(n)``), for studies that want it; it is
not the default. On ``fmtkit ablate``'s tiny model the paired SE of a setup's gap to fp32
comes out several times smaller than the Welch SE: pairing is what the seeds share.

A seed whose value is not finite (a diverged run) makes the mean, the gap and the SE NaN
and the gap not significant (NaN in, NaN out); ``SeedStats.n_nonfinite`` counts such seeds
and ``format_mean_std`` prints them as "diverged k/n" rather than hiding them.

Table cells and plots
---------------------
* ``format_mean_std(stats)``: ``"2.3456 ± 0.0012"`` (decimals from the std: 2 significant
  digits of the spread).
* ``format_gap(gap)``: ``"+0.12% ± 0.05% *"``: the gap relative to A's mean, ± the std of
  one seed's gap (``Gap.std`` = sqrt(s_a^2 + s_b^2), paired: std(b_i - a_i)), and ``*``
  (``MARK``) when significant by the rule. ``SIGNIFICANCE_NOTE`` is a table footnote
  stating the rule.
* ``band(ax, x, runs)`` / ``plot_seed_bands(curves, out_dir)``: mean curve over seeds with
  a ±1 std band; ``gap_bars(ax, gaps)`` / ``plot_gap_bars(gaps, out_dir)``: a bar per setup
  with ±3 SE whiskers, so a whisker that does not reach 0 is a significant gap.
  Object-oriented matplotlib on the Agg canvas (``studies.lib.common.figure``); PNG files.

Example:
  >>> a = summarize([2.00, 2.01, 1.99])
  >>> (round(a.mean, 6), round(a.std, 6), a.n)
  (2.0, 0.01, 3)
  >>> g = compare([2.00, 2.01, 1.99], [2.10, 2.11, 2.09])
  >>> (round(g.gap, 6), round(g.se, 6), g.significant)
  (0.1, 0.008165, True)
  >>> format_gap(g)
  '+5.00% ± 0.71% *'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MARK",
    "PAIRED_NOTE",
    "SIGNIFICANCE_NOTE",
    "THRESHOLD",
    "Gap",
    "SeedStats",
    "band",
    "compare",
    "format_gap",
    "format_mean_std",
    "gap_bars",
    "plot_gap_bars",
    "plot_seed_bands",
    "stack_runs",
    "summarize",
]

THRESHOLD = 3.0
"""A gap is significant when it exceeds this many standard errors of the difference (module
docstring: why 3 and what it means with 3 seeds)."""

MARK = "*"
"""The significance mark appended to a table cell."""

SIGNIFICANCE_NOTE = (f"gap: mean over seeds of (setup - reference), relative to the "
                     f"reference mean, ± the std of one seed's gap; {MARK}: |gap| > "
                     f"{THRESHOLD:g} standard errors of the difference (Welch, seeds "
                     f"independent).")
"""A footnote for tables that use ``format_gap``."""

PAIRED_NOTE = (f"gap: mean over seeds of (setup - reference), ± the std of one seed's gap; "
               f"{MARK}: |gap| > {THRESHOLD:g} standard errors of the per-seed differences "
               f"(paired: seed k of both setups shares its parameters and batches).")
"""The footnote for gaps from ``compare(..., paired=True)``."""


def _as_values(values: Any, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of per-seed numbers, got shape "
                         f"{v.shape}.")
    if v.size == 0:
        raise ValueError(f"{name} must hold at least one seed's value, got none.")
    return v


@dataclasses.dataclass(frozen=True)
class SeedStats:
    """Summary of one setup's per-seed values.

    Attributes:
      values: the per-seed values, in seed order (kept for results JSON).
      n: number of seeds.
      mean: their mean (NaN if any value is not finite).
      std: sample standard deviation, ddof = 1 (NaN when n < 2 or a value is not finite).
      sem: standard error of the mean, std / sqrt(n).
      n_nonfinite: seeds whose value is NaN or inf (diverged runs).
    """

    values: tuple[float, ...]
    n: int
    mean: float
    std: float
    sem: float
    n_nonfinite: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN stays NaN; ``studies.lib.common.to_jsonable`` maps it to null)."""
        return dataclasses.asdict(self) | {"values": list(self.values)}


def summarize(values: Sequence[float] | np.ndarray) -> SeedStats:
    """Mean, sample std (ddof = 1) and standard error of per-seed values.

    Args:
      values: one number per seed (e.g. each seed's final loss).

    Returns:
      A ``SeedStats``. With one seed the std and the SE are NaN (a spread needs two).

    Raises:
      ValueError: ``values`` is empty or not 1-D.
    """
    v = _as_values(values, "values")
    n = int(v.size)
    bad = int(np.sum(~np.isfinite(v)))
    if bad:
        mean = std = float("nan")
    else:
        mean = float(np.mean(v))
        std = float(np.std(v, ddof=1)) if n >= 2 else float("nan")
    return SeedStats(tuple(float(x) for x in v), n, mean, std, std / math.sqrt(n), bad)


@dataclasses.dataclass(frozen=True)
class Gap:
    """Candidate minus reference over seeds (``compare``).

    Attributes:
      reference, candidate: the two setups' ``SeedStats``.
      gap: mean(candidate) - mean(reference).
      se: standard error of ``gap``: sqrt(s_a^2/n + s_b^2/m) (paired: std(d)/sqrt(n)).
      std: spread of one seed's gap: sqrt(s_a^2 + s_b^2) (paired: std(d)).
      z: gap / se (inf when se == 0 and gap != 0; NaN when undefined).
      dof: Welch-Satterthwaite degrees of freedom (paired: n - 1).
      p_value: two-sided P(|T| > |z|) for Student's t with ``dof`` degrees of freedom
        (informational; the rule is the threshold).
      threshold: the rule's factor (3 by default).
      significant: |gap| > threshold * se, both setups with >= 2 finite seeds.
      paired: whether the paired SE was used.
    """

    reference: SeedStats
    candidate: SeedStats
    gap: float
    se: float
    std: float
    z: float
    dof: float
    p_value: float
    threshold: float
    significant: bool
    paired: bool

    def _per_reference(self, value: float) -> float:
        ref = abs(self.reference.mean)
        return value / ref if ref > 0 else float("nan")  # NaN when the reference mean is 0

    @property
    def relative(self) -> float:
        """gap / |mean(reference)|, a fraction (multiply by 100 for %); NaN if that is 0."""
        return self._per_reference(self.gap)

    @property
    def relative_se(self) -> float:
        """se / |mean(reference)|: the same rule in relative units (the reference mean is
        treated as a constant; its own spread is already part of ``se``)."""
        return self._per_reference(self.se)

    @property
    def relative_std(self) -> float:
        """std / |mean(reference)|."""
        return self._per_reference(self.std)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the relative values, and each seed's numbers."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["reference"] = self.reference.to_dict()
        d["candidate"] = self.candidate.to_dict()
        d.update(relative=self.relative, relative_se=self.relative_se,
                 relative_std=self.relative_std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Gap:
        """The ``Gap`` of a ``to_dict`` (e.g. read back from results.json): recomputed by
        ``compare`` from the per-seed values it holds, with its threshold and pairing."""
        return compare(d["reference"]["values"], d["candidate"]["values"],
                       threshold=d["threshold"], paired=d["paired"])


def _t_two_sided(t: float, dof: float) -> float:
    if math.isinf(t):  # a nonzero gap with zero spread
        return 0.0
    if not (math.isfinite(dof) and dof > 0) or math.isnan(t):
        return float("nan")
    from scipy import stats as sps  # a dependency of jax; imported only when needed

    return float(2.0 * sps.t.sf(abs(t), dof))


def compare(reference: Sequence[float] | np.ndarray, candidate: Sequence[float] | np.ndarray,
            *, threshold: float = THRESHOLD, paired: bool = False) -> Gap:
    """The gap candidate - reference over seeds and whether it exceeds ``threshold`` SEs.

    Args:
      reference: per-seed values of the reference setup (e.g. fp32's final losses).
      candidate: per-seed values of the setup compared with it.
      threshold: significant when |gap| > threshold * SE (default 3, module docstring).
      paired: use the SE of the per-seed differences (seed i of both setups shares its
        initial parameters and batches); needs equally many seeds. Default: Welch,
        seeds independent.

    Returns:
      A ``Gap``.

    Raises:
      ValueError: empty or non-1-D inputs; ``threshold`` not > 0; ``paired`` with unequal
        seed counts.
    """
    a = _as_values(reference, "reference")
    b = _as_values(candidate, "candidate")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}.")
    sa, sb = summarize(a), summarize(b)
    gap = sb.mean - sa.mean
    if paired:
        if a.size != b.size:
            raise ValueError(f"paired=True needs as many candidate seeds as reference seeds, "
                             f"got {b.size} and {a.size}.")
        d = summarize(b - a)
        std, se, dof = d.std, d.sem, float(d.n - 1)
    else:
        va, vb = sa.std**2, sb.std**2
        std = math.sqrt(va + vb)
        se = math.sqrt(va / sa.n + vb / sb.n)
        ua, ub = va / sa.n, vb / sb.n
        dof = ((ua + ub) ** 2 / (ua**2 / (sa.n - 1) + ub**2 / (sb.n - 1))
               if sa.n >= 2 and sb.n >= 2 and ua + ub > 0 else float("nan"))
    if math.isnan(gap) or math.isnan(se):
        z = float("nan")
    elif se == 0.0:
        z = 0.0 if gap == 0.0 else math.copysign(math.inf, gap)
    else:
        z = gap / se
    significant = bool(not math.isnan(z) and abs(gap) > threshold * se)
    return Gap(sa, sb, gap, se, std, z, dof, _t_two_sided(z, dof), float(threshold),
               significant, bool(paired))


# ---------------------------------------------------------------------------------------------
# Table cells


def _decimals(spread: float, default: int) -> int:
    """Decimals that show 2 significant digits of ``spread`` (0..8)."""
    if not math.isfinite(spread) or spread <= 0:
        return default
    return int(min(8, max(0, 1 - math.floor(math.log10(spread)))))


def format_mean_std(stats: SeedStats | Sequence[float], *, decimals: int | None = None) -> str:
    """``"mean ± std"`` of per-seed values, e.g. ``"2.3456 ± 0.0012"``.

    Args:
      stats: a ``SeedStats`` or the per-seed values.
      decimals: fixed decimals; None: enough for 2 significant digits of the std (4 when
        the std is 0 or undefined).

    Returns:
      The cell; ``"2.3456"`` for a single seed, ``"diverged k/n"`` when k seeds are not
      finite.
    """
    s = stats if isinstance(stats, SeedStats) else summarize(stats)
    if s.n_nonfinite:
        return f"diverged {s.n_nonfinite}/{s.n}"
    k = _decimals(s.std, 4) if decimals is None else decimals
    if s.n < 2:
        return f"{s.mean:.{k}f}"
    return f"{s.mean:.{k}f} ± {s.std:.{k}f}"


def format_gap(gap: Gap, *, relative: bool = True, decimals: int | None = None,
               mark: str = MARK) -> str:
    """A gap cell: ``"+0.12% ± 0.05% *"`` (relative) or ``"+0.0024 ± 0.0010 *"``.

    The number after ± is ``Gap.std`` (the spread of one seed's gap), the mark says
    |gap| > threshold * SE (``SIGNIFICANCE_NOTE``).

    Args:
      gap: from ``compare``.
      relative: in % of the reference mean (default) or in the values' units.
      decimals: fixed decimals; None: 2 significant digits of the spread.
      mark: appended (after a space) when the gap is significant.

    Returns:
      The cell; ``"diverged"`` when either setup has a non-finite seed.
    """
    if gap.reference.n_nonfinite or gap.candidate.n_nonfinite:
        return "diverged"
    if relative and gap.reference.mean == 0:
        raise ValueError("a relative gap needs a nonzero reference mean; use relative=False.")
    scale, unit = (100.0 / abs(gap.reference.mean), "%") if relative else (1.0, "")
    value, spread = gap.gap * scale, gap.std * scale
    k = _decimals(spread, 2 if relative else 4) if decimals is None else decimals
    cell = f"{value:+.{k}f}{unit}"
    if math.isfinite(spread):
        cell += f" ± {spread:.{k}f}{unit}"
    return cell + (f" {mark}" if gap.significant else "")


# ---------------------------------------------------------------------------------------------
# Plots


def stack_runs(runs: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """Per-seed curves of possibly different lengths (a diverged run stops early) as a
    float64 array [seeds, max_len], padded with NaN."""
    if isinstance(runs, np.ndarray) and runs.ndim == 2:
        return runs.astype(np.float64)
    rows = [np.asarray(r, np.float64).ravel() for r in runs]
    if not rows:
        raise ValueError("runs must hold at least one seed's curve.")
    out = np.full((len(rows), max(r.size for r in rows)), np.nan)
    for i, r in enumerate(rows):
        out[i, :r.size] = r
    return out


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing moving average over ``k`` points (the first k-1 points average fewer)."""
    if k <= 1:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    n = np.arange(1, y.size + 1)
    lo = np.maximum(n - k, 0)
    return (c[n] - c[lo]) / (n - lo)


def band(ax: Any, x: Sequence[float] | np.ndarray, runs: Sequence[Sequence[float]] | np.ndarray,
         *, label: str | None = None, color: Any = None, smooth: int = 1,
         alpha: float = 0.2) -> tuple[Any, Any]:
    """Draws the mean over seeds and a ±1 std band on ``ax``.

    Args:
      ax: a matplotlib Axes.
      x: the steps, [T].
      runs: per-seed curves, [seeds, T] (``stack_runs`` pads shorter ones with NaN).
      label, color: of the mean line (the band shares the colour).
      smooth: each seed's curve is first averaged over this many trailing steps.
      alpha: opacity of the band.

    Returns:
      ``(line, band)``: the Line2D of the mean and the PolyCollection of the band. Steps
      where a seed is NaN are NaN in the mean (a gap in the line), not averaged around.
    """
    y = stack_runs(runs)
    x = np.asarray(x, np.float64)
    if y.shape[1] != x.size:
        raise ValueError(f"runs have {y.shape[1]} steps but x has {x.size}.")
    if smooth > 1:
        y = np.stack([_smooth(r, smooth) for r in y])
    mean = y.mean(axis=0)
    std = y.std(axis=0, ddof=1) if y.shape[0] > 1 else np.zeros_like(mean)
    (line,) = ax.plot(x, mean, color=color, label=label)
    poly = ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=alpha,
                           linewidth=0)
    return line, poly


def gap_bars(ax: Any, gaps: Mapping[str, Gap], *, relative: bool = True) -> Any:
    """Horizontal bars of the gaps with ±threshold·SE whiskers on ``ax``.

    Significant gaps are drawn solid and their label gets ``MARK``; the others are pale.
    A whisker that does not cross the zero line is a significant gap.

    Returns:
      The ``ErrorbarContainer`` of the whiskers (bar i: centre ``gap``, half-width
      ``threshold * se``, in % of the reference mean when ``relative``).
    """
    names = list(gaps)
    if relative and any(g.reference.mean == 0 for g in gaps.values()):
        raise ValueError("a relative gap needs a nonzero reference mean; use relative=False.")
    scale = [100.0 / abs(g.reference.mean) if relative else 1.0 for g in gaps.values()]
    vals = np.array([g.gap * s for g, s in zip(gaps.values(), scale)])
    errs = np.array([g.threshold * g.se * s for g, s in zip(gaps.values(), scale)])
    pos = np.arange(len(names))[::-1]
    colors = ["#1f77b4" if g.significant else "#aec7e8" for g in gaps.values()]
    ax.barh(pos, vals, color=colors, height=0.6)
    eb = ax.errorbar(vals, pos, xerr=errs, fmt="none", ecolor="k", elinewidth=1, capsize=3)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(pos, [n + (f" {MARK}" if g.significant else "")
                        for n, g in zip(names, gaps.values())])
    ax.set_xlabel(("gap (% of reference)" if relative else "gap")
                  + f", whiskers ±{next(iter(gaps.values())).threshold:g} SE"
                  if gaps else "gap")
    return eb


def plot_seed_bands(curves: Mapping[str, Sequence[Sequence[float]] | np.ndarray],
                    out_dir: str | Path, name: str = "seed_bands", *,
                    ylabel: str = "training loss (nats/byte)", title: str | None = None,
                    smooth: int = 1, hline: float | None = None) -> Path:
    """``out_dir/name.png``: one mean ± std band per setup over steps.

    Args:
      curves: setup name -> per-seed curves [seeds, steps] (steps 0..T-1).
      out_dir: an existing folder.
      name: file name without ``.png``.
      ylabel, title: axis label and title.
      smooth: trailing moving average over this many steps before the statistics.
      hline: a horizontal reference line (e.g. the corpus entropy floor).

    Returns:
      The PNG's path.
    """
    from studies.lib.common import figure, plot_style, save

    with plot_style():
        fig, ax = figure(width=7.0, height=4.4)
        for label, runs in curves.items():
            y = stack_runs(runs)
            band(ax, np.arange(y.shape[1]), y, label=f"{label} (n={y.shape[0]})",
                 smooth=smooth)
        if hline is not None:
            ax.axhline(hline, color="k", lw=0.8, ls=":")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title or "mean over seeds, band ±1 std")
        ax.legend(fontsize=7)
        return save(fig, out_dir, name)


def plot_gap_bars(gaps: Mapping[str, Gap], out_dir: str | Path, name: str = "gaps", *,
                  relative: bool = True, title: str | None = None) -> Path:
    """``out_dir/name.png``: ``gap_bars`` of every setup against its reference.

    Returns:
      The PNG's path.
    """
    from studies.lib.common import figure, plot_style, save

    with plot_style():
        fig, ax = figure(width=6.4, height=1.0 + 0.35 * max(len(gaps), 1))
        gap_bars(ax, gaps, relative=relative)
        k = next(iter(gaps.values())).threshold if gaps else THRESHOLD
        ax.set_title(title or f"final-loss gap over seeds ({MARK}: > {k:g} SE, Welch)")
        return save(fig, out_dir, name)
