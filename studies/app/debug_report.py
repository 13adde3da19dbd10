"""``fmtkit debug RUNDIR``: the worst GEMMs of a run's statistics log, and plots over steps.

Reads ``RUNDIR/stats.jsonl`` (written by ``fmtkit.debug.log.StatsLogger``) and prints, for
each metric, the ``--top`` entries (module path, GEMM, tensor) whose worst value over the
logged steps is the worst, with that value and the step it was reached at (the earliest such
step on a tie). Worst means largest for every metric but ``sqnr_db``, where it is the
smallest. The precision decisions of ``RUNDIR/decisions.jsonl``, if any, follow the
tables. ``--plots`` writes one PNG per module into ``RUNDIR/plots``: a panel per metric,
one line per GEMM and tensor, over the logged steps.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from fmtkit.debug.log import DECISIONS_NAME, JSONL_NAME, split_tag

# metric: True if larger is worse. The defaults are the figures an FP8 run goes wrong by.
METRICS: dict[str, bool] = {
    "underflow_share": True,
    "saturation_share": True,
    "sqnr_db": False,
    "dynamic_range": True,
    "max_blockwise_dynamic_range": True,
    "nonfinite_count": True,
    "mse": True,
    "amax": True,
}
DEFAULT_METRICS = ("underflow_share", "saturation_share", "sqnr_db", "dynamic_range")
# Reading shows a progress bar from this many bytes of log on (about a few seconds of parsing).
_PROGRESS_BYTES = 64 * 2**20


def read_log(rundir: str | Path) -> list[tuple[int, dict[str, float]]]:
    """The logged steps of ``RUNDIR/stats.jsonl`` as ``[(step, {tag: value})]`` in file order.

    A torn line (what a run killed while writing it left) is skipped with a warning.

    Raises:
      ValueError: naming RUNDIR if it is not a directory, has no stats.jsonl, the file holds
        no logged step, or a line is not a JSON object with "step" and "stats".
    """
    rundir = Path(rundir)
    if not rundir.is_dir():
        raise ValueError(f"RUNDIR {str(rundir)!r} is not a directory")
    path = rundir / JSONL_NAME
    if not path.is_file():
        raise ValueError(f"RUNDIR {str(rundir)!r} has no {JSONL_NAME} (write one with "
                         "fmtkit.debug.log.StatsLogger)")
    records = []
    size = path.stat().st_size
    where = f"RUNDIR {str(rundir)!r}: {JSONL_NAME}"
    with path.open(encoding="utf-8") as f, _progress(size, "reading " + JSONL_NAME) as bar:
        for lineno, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                rec = _record(line, f"{where} line {lineno}")
                if rec is None:
                    continue
                step, stats = int(rec["step"]), rec["stats"]
                if not isinstance(stats, dict):
                    raise TypeError("stats is not an object")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{where} line {lineno} is not "
                                 f'{{"step": int, "stats": {{tag: value}}}} ({e})') from None
            records.append((step, {t: float(v) for t, v in stats.items()}))
    if not records:
        raise ValueError(f"RUNDIR {str(rundir)!r}: {JSONL_NAME} holds no logged step")
    return records


def read_decisions(rundir: str | Path) -> list[dict]:
    """The records of ``RUNDIR/decisions.jsonl`` (``[]`` without the file), torn lines
    skipped with a warning."""
    path = Path(rundir) / DECISIONS_NAME
    if not path.is_file():
        return []
    where = f"RUNDIR {str(rundir)!r}: {DECISIONS_NAME}"
    lines = path.read_text(encoding="utf-8").splitlines()
    records = (_record(line, f"{where} line {i}") for i, line in enumerate(lines, 1)
               if line.strip())
    return [r for r in records if r is not None]


# Every record StatsLogger writes (a logged step, a decision) is a JSON object whose first key
# is "step" (json.dumps keeps the order of the dict it writes).
_RECORD_START = '{"step": '


def _record(line: str, where: str) -> dict | None:
    """The JSON object of one line of a log, or None for a torn line (what a run killed while
    writing it left: a start of a record that does not parse), with a warning. A record that
    a resumed writer appended to a torn line without ending it (an older fmtkit) follows
    the torn bytes on the same line: that record is returned.

    Raises:
      ValueError: the line is neither JSON nor a torn record.
    """
    try:
        return json.loads(line)
    except ValueError:
        if not line.startswith(_RECORD_START):
            raise
    start = line.rfind(_RECORD_START)
    if start > 0:
        try:
            rec = json.loads(line[start:])
        except ValueError:
            pass
        else:
            warnings.warn(f"{where} starts with a torn record (a run killed while writing "
                          "it): skipped it, read the record after it.", stacklevel=3)
            return rec
    warnings.warn(f"{where} is a torn record (a run killed while writing it): skipped.",
                  stacklevel=3)
    return None


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=total < _PROGRESS_BYTES)


def check_metrics(metrics: Iterable[str]) -> tuple[str, ...]:
    """The metrics, validated against ``METRICS`` (ValueError naming --metric otherwise)."""
    metrics = tuple(metrics)
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"--metric {bad[0]!r} is not a known metric; valid: "
                         f"{', '.join(METRICS)}")
    return metrics


def worst(records: Sequence[tuple[int, dict[str, float]]], metric: str,
          top: int) -> list[dict]:
    """The ``top`` worst (module, gemm, tensor) entries of one metric over the logged steps.

    Returns:
      Rows ``{"metric", "module", "gemm", "tensor", "value", "step"}``, worst first; ties in
      value go by tag order. An entry's value is its worst over the steps, and ``step`` the
      first step that reached it. NaN values are ignored.
    """
    larger_is_worse = METRICS[metric]
    best: dict[str, tuple[float, int]] = {}
    for step, stats in records:
        for tag, v in stats.items():
            if math.isnan(v):
                continue
            module, gemm, tensor, stat = split_tag(tag)
            if stat != metric:
                continue
            key = f"{module}\0{gemm}\0{tensor}"
            old = best.get(key)
            if old is None or (v > old[0] if larger_is_worse else v < old[0]):
                best[key] = (v, step)
    sign = -1.0 if larger_is_worse else 1.0
    order = sorted(best.items(), key=lambda kv: (sign * kv[1][0], kv[0]))
    rows = []
    for key, (v, step) in order[:top]:
        module, gemm, tensor = key.split("\0")
        rows.append({"metric": metric, "module": module, "gemm": gemm, "tensor": tensor,
                     "value": v, "step": step})
    return rows


def summarize(records, metrics: Sequence[str], top: int) -> dict[str, list[dict]]:
    """``{metric: worst(records, metric, top)}`` for each metric."""
    return {m: worst(records, m, top) for m in metrics}


def _safe_name(module: str) -> str:
    """A file name for a module's plots: ``"Block_0/Dense_1"`` -> ``"Block_0.Dense_1"``; one
    layer of a scanned stack ``"layers/Dense_0[3]"`` -> ``"layers.Dense_0_3"`` (the root's
    ``"[3]"`` -> ``"root_3"``)."""
    if not module or module.startswith("["):
        module = "root" + module
    module = re.sub(r"\[(\d+(?:,\d+)*)\]", lambda m: "_" + m.group(1).replace(",", "_"),
                    module)
    return re.sub(r"[^\w.-]+", ".", module)


def write_plots(records, metrics: Sequence[str], outdir: Path) -> list[Path]:
    """One PNG per module: a panel per metric, a line per (GEMM, tensor) over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    series: dict[str, dict[str, dict[str, tuple[list[int], list[float]]]]] = {}
    for step, stats in records:
        for tag, v in stats.items():
            module, gemm, tensor, stat = split_tag(tag)
            if stat not in metrics or math.isnan(v):
                continue
            xs, ys = series.setdefault(module, {}).setdefault(stat, {}).setdefault(
                f"{gemm}/{tensor}", ([], []))
            xs.append(step)
            ys.append(v)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    # A progress bar from 20 modules on (a deep model: each figure takes a fraction of a second).
    for module in tqdm(sorted(series), desc="plots", file=sys.stderr,
                       disable=len(series) < 20):
        stats = [m for m in metrics if m in series[module]]
        fig, axes = plt.subplots(len(stats), 1, figsize=(7, 2.6 * len(stats)), squeeze=False)
        for ax, stat in zip(axes[:, 0], stats):
            for label, (xs, ys) in sorted(series[module][stat].items()):
                ax.plot(xs, ys, marker=".", label=label)
            ax.set_ylabel(stat)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle(module or "(root)")
        fig.tight_layout()
        path = outdir / f"{_safe_name(module)}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def main(argv: Sequence[str] | None = None) -> int:
    """``fmtkit debug RUNDIR [--top N] [--metric M ...] [--plots] [--json]``."""
    p = argparse.ArgumentParser(prog="fmtkit debug", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rundir", metavar="RUNDIR", help=f"a directory holding {JSONL_NAME}")
    p.add_argument("--top", type=int, default=10, help="entries per metric (default 10)")
    p.add_argument("--metric", action="append",
                   help=f"a metric (repeatable; default {', '.join(DEFAULT_METRICS)}; "
                        f"valid: {', '.join(METRICS)})")
    p.add_argument("--plots", action="store_true", help="write RUNDIR/plots/<module>.png")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    explicit = args.metric is not None
    metrics = check_metrics(args.metric if explicit else DEFAULT_METRICS)
    records = read_log(args.rundir)
    summary = summarize(records, metrics, args.top)
    if explicit:
        absent = [m for m, rows in summary.items() if not rows]
        if absent:
            raise ValueError(f"--metric {absent[0]!r} is not in {JSONL_NAME} of "
                             f"RUNDIR {args.rundir!r}")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        steps = [s for s, _ in records]
        print(f"{args.rundir}: {len(records)} logged steps ({min(steps)}..{max(steps)})")
        for metric, rows in summary.items():
            how = "lowest" if not METRICS[metric] else "highest"
            print(f"\n{metric} ({how} first)")
            if not rows:
                print("  (not in this log)")
                continue
            table = [[r["module"] or "(root)", r["gemm"], r["tensor"], _fmt(r["value"]),
                      str(r["step"])] for r in rows]
            _print_table(["module", "gemm", "tensor", metric, "step"], table)
        decisions = read_decisions(args.rundir)
        if decisions:
            print(f"\nprecision decisions ({DECISIONS_NAME})")
            _print_table(["step", "module", "gemm", "setting", "stat", "value"],
                         [[str(d["step"]), d["module"] or "(root)", d["gemm"], d["setting"],
                           d["stat"], _fmt(float(d["value"]))] for d in decisions])
    if args.plots:
        paths = write_plots(records, metrics, Path(args.rundir) / "plots")
        print(f"\nwrote {len(paths)} plots to {Path(args.rundir) / 'plots'}",
              file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))).rstrip())
    for r in rows:
        print(("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip())
