"""Helpers shared by the studies: results files, versions, run folders, progress, plot style.

A study module (``studies/numerics/<name>.py`` or ``studies/lm/<name>.py``) exposes

* ``Config``: a frozen dataclass whose fields become the CLI options (``--steps 20``); its
  docstring's ``Attributes:`` section becomes the options' help; ``__post_init__`` validates
  (``ValueError`` / ``TypeError`` naming the field and the allowed values);
* ``run(config, progress=no_progress) -> dict``: pure (no files, no printing), so tests import
  it; long loops wrap their iterable in ``progress(iterable, total=..., desc=...)``;
* optionally ``summarize(results) -> str`` (a table for the terminal) and
  ``plot(results, out_dir) -> list[Path]`` (PNG files, written with ``figure`` / ``save``).

``studies.app.runner`` turns that into ``fmtkit study NAME``: options, ``runs/NAME/<timestamp>/``,
``results.json`` (config, versions, device, wall times, the numbers), the PNGs and the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FORMAT_COLORS",
    "PLOT_STYLE",
    "Progress",
    "StudyError",
    "environment",
    "figure",
    "format_table",
    "make_progress",
    "no_progress",
    "plot_style",
    "run_dir",
    "save",
    "to_jsonable",
    "write_results",
]

VERSIONED_PACKAGES = ("fmtkit", "jax", "jaxlib", "flax", "optax", "ml_dtypes", "numpy")


class StudyError(RuntimeError):
    """An expected failure of a run with a clear message (e.g. "loss is NaN at step 120 under
    policy fp16 (no loss scaling)"): the runner prints it and exits with status 1, no trace."""


class Progress(Protocol):
    """What ``run`` receives as ``progress``: wraps an iterable, like ``tqdm.tqdm``."""

    def __call__(self, iterable: Iterable[Any], *, total: int | None = None,
                 desc: str | None = None) -> Iterable[Any]: ...


def no_progress(iterable: Iterable[Any], *, total: int | None = None,
                desc: str | None = None) -> Iterable[Any]:
    """The default ``progress``: returns the iterable unchanged (tests, library use)."""
    del total, desc
    return iterable


def make_progress(enabled: bool | None = None, delay: float = 2.0) -> Progress:
    """A tqdm progress bar factory for ``run(config, progress=...)``.

    Args:
      enabled: show bars; ``None`` (default) means "when stderr is a terminal".
      delay: seconds before a bar appears, so that only loops longer than that show one.

    Returns:
      A callable with the ``Progress`` signature.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return no_progress
    from tqdm import tqdm

    def progress(iterable: Iterable[Any], *, total: int | None = None,
                 desc: str | None = None) -> Iterator[Any]:
        return iter(tqdm(iterable, total=total, desc=desc, delay=delay, leave=False,
                         dynamic_ncols=True, file=sys.stderr))

    return progress


# ---------------------------------------------------------------------------------------------
# Results


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The repository's HEAD commit, when the studies run from a git checkout (read-only)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


EXACT_LOW_PRECISION_FLAG = "--xla_allow_excess_precision=false"
"""Keeps XLA from holding bf16/fp16 intermediates in f32 inside ``jit`` (on CPU it does by
default), which would skip the very roundings the studies measure."""


def excess_precision_allowed() -> bool:
    """Whether ``XLA_FLAGS`` lacks ``EXACT_LOW_PRECISION_FLAG`` (the CLI always sets it)."""
    return EXACT_LOW_PRECISION_FLAG not in os.environ.get("XLA_FLAGS", "")


def environment() -> dict[str, Any]:
    """Versions, device and machine, recorded in every ``results.json``."""
    import jax

    dev = jax.devices()[0]
    return {
        "versions": {p: _version(p) for p in VERSIONED_PACKAGES},
        "python": platform.python_version(),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "device_count": jax.device_count(),
        "machine": platform.machine(),
        "git_commit": _git_commit(),
        "xla_allow_excess_precision": excess_precision_allowed(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def to_jsonable(obj: Any) -> Any:
    """Converts study results to strict JSON types.

    Dataclasses become dicts, tuples lists, NumPy/JAX arrays and scalars Python lists and
    numbers, paths strings. Non-finite floats become the strings ``"inf"``, ``"-inf"`` and
    ``"nan"`` (strict JSON has no such numbers; ``float("inf")`` reads them back).
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (str, bool)) or obj is None:
        return obj
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "__array__") or isinstance(obj, np.generic):
        arr = np.asarray(obj)
        if arr.dtype == np.bool_:
            return to_jsonable(arr.tolist())
        if np.issubdtype(arr.dtype, np.integer):
            return arr.tolist()
        return to_jsonable(arr.astype(np.float64).tolist())
    raise TypeError(f"Cannot write {type(obj).__name__} to results.json: {obj!r}")


def run_dir(root: str | Path, name: str) -> Path:
    """Creates and returns a fresh ``root/name/<YYYYmmdd-HHMMSS>[-k]/`` folder."""
    base = Path(root) / name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = base / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            path.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{base}/{stamp}-*: too many runs in the same second")


def write_results(path: Path, record: Mapping[str, Any]) -> Path:
    """Writes ``record`` as indented strict JSON to ``path`` (a file) and returns it; the
    studies' runner, the benchmarks and the GPU check write through it."""
    path.write_text(json.dumps(to_jsonable(record), indent=2, allow_nan=False) + "\n")
    return path


def write_bench_results(name: str, results: Mapping[str, Any],
                        out_dir: str | Path | None = None) -> Path:
    """Writes a benchmark's ``results`` with the ``environment()`` to
    ``out_dir/results.json`` (default ``runs/bench-NAME/``) and returns the file."""
    folder = Path(out_dir or Path("runs") / f"bench-{name}")
    folder.mkdir(parents=True, exist_ok=True)
    return write_results(folder / "results.json", {"env": environment(), **results})


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: str | None = None) -> str:
    """A plain-text table with left-aligned columns (cells are converted with ``str``)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots (object-oriented matplotlib with the Agg canvas: no pyplot, no global backend change)

PLOT_STYLE: dict[str, Any] = {
    "figure.dpi": 110,
    "savefig.dpi": 130,
    "savefig.bbox": "tight",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "lines.linewidth": 1.6,
}

FORMAT_COLORS: dict[str, str] = {
    "float32": "#1f77b4",
    "bfloat16": "#2ca02c",
    "float16": "#d62728",
    "float8_e4m3fn": "#9467bd",
    "float8_e5m2": "#ff7f0e",
}
"""One colour per common format, the same in every plot."""


@contextlib.contextmanager
def plot_style() -> Iterator[None]:
    """Applies ``PLOT_STYLE`` to the figures made and saved inside the block."""
    import matplotlib

    with matplotlib.rc_context(PLOT_STYLE):
        yield


def figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.4,
           height: float = 4.0) -> tuple[Any, Any]:
    """A new Agg-backed ``Figure`` and its axes (``fig.subplots(nrows, ncols)``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=True)


def save(fig: Any, out_dir: str | Path, name: str) -> Path:
    """Saves ``fig`` as ``out_dir/name.png`` and returns the path."""
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, format="png")
    return path

