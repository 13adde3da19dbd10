"""Runs a study: ``fmtkit study NAME [--option value ...]``, ``fmtkit study --list``.

Each study is a module of ``studies/numerics/`` or ``studies/lm/`` that declares its
command-line id, summary and place in the list (``NAME``, ``SUMMARY``, ``ORDER``: see
``studies.app.registry``) and the protocol of ``studies.lib.common`` (``Config``, a pure
``run``, optional ``summarize`` and ``plot``). The runner derives the command-line options
from the fields of the study's ``Config`` (with tyro, nested dataclasses included), runs it, writes
``runs/NAME/<timestamp>/results.json`` (config, versions, device, wall times, the numbers) and
the PNG plots, and prints the study's summary table.

Adding a study: write its module; the runner finds it (``STUDIES`` is derived, never edited).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import time
import types
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import tyro

from studies.app.registry import discover
from studies.lib.common import (
    EXACT_LOW_PRECISION_FLAG,
    Progress,
    StudyError,
    environment,
    excess_precision_allowed,
    make_progress,
    run_dir,
    write_results,
)
from studies.training import distributed

__all__ = ["GROUPS", "MODULES", "RESERVED_OPTIONS", "STUDIES", "Invocation", "load", "main",
           "module_name", "parse_args", "run_study"]

GROUPS = ("studies.numerics", "studies.lm")
"""The folders whose modules are the studies: numerics without training, language models."""

_ENTRIES = discover(*GROUPS, ordered=True)
STUDIES: dict[str, str] = {e.name: e.summary for e in _ENTRIES}
"""Each study's ``NAME``: its ``SUMMARY``, in ``--list`` order (each module's ``ORDER``)."""
MODULES: dict[str, str] = {e.name: e.module for e in _ENTRIES}
"""Each study's ``NAME``: its module (``"formats"``: ``"studies.numerics.format_ranges"``)."""

RESERVED_OPTIONS = ("out", "plot")
"""Options the runner adds to every study; a ``Config`` must not use these field names."""


def module_name(name: str) -> str:
    """``"fp8-outliers"`` -> ``"studies.numerics.fp8_outliers"`` (``MODULES``)."""
    return MODULES[_check_name(name)]


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"study name must be a str, got {type(name).__name__}.")
    canonical = name.replace("_", "-")
    if canonical not in STUDIES:
        raise ValueError(f"unknown study {name!r}; valid studies: {', '.join(STUDIES)}.")
    return canonical


def load(name: str) -> types.ModuleType:
    """Imports the study module registered as ``name`` and checks its protocol.

    Raises:
      ValueError: ``name`` is not registered (the message lists the valid names).
      TypeError: the module lacks a frozen dataclass ``Config`` or a callable ``run``.
    """
    name = _check_name(name)
    module = importlib.import_module(module_name(name))
    cfg = getattr(module, "Config", None)
    if not (isinstance(cfg, type) and dataclasses.is_dataclass(cfg)
            and cfg.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{module.__name__}.Config must be a frozen dataclass.")
    if not callable(getattr(module, "run", None)):
        raise TypeError(f"{module.__name__} must define run(config) -> dict.")
    return module


# ---------------------------------------------------------------------------------------------
# Options from the Config dataclass (tyro)


@dataclasses.dataclass(frozen=True)
class Invocation:
    """A parsed ``fmtkit study NAME ...`` command line.

    Attributes:
      config: the study's ``Config``.
      out: results go to ``out/NAME/<timestamp>/``.
      plot: write the study's PNG plots.
    """

    config: Any
    out: Path = Path("runs")
    plot: bool = True


def parse_args(name: str, argv: list[str], module: types.ModuleType | None = None
               ) -> Invocation:
    """Parses the options of ``fmtkit study NAME`` with tyro: one option per ``Config`` field.

    Nested dataclasses (a study's ``train: TrainConfig``) contribute their fields without a
    prefix (``--steps``, not ``--train.steps``). Field ``n_steps: int = 100`` becomes
    ``--n-steps INT``; ``bool`` fields ``--flag / --no-flag``; ``tuple[float, ...]`` fields
    take one value per argument; ``Literal[...]`` fields list their choices; ``X | None``
    fields take an X or ``None``. The help of each option is the field's entry in the
    ``Attributes:`` section of the Config's docstring.

    Raises:
      SystemExit: ``--help`` (code 0) or a bad option or value (code 2, message printed).
      TypeError: a ``Config`` field named like a runner option (``RESERVED_OPTIONS``), or a
        value ``Config.__post_init__`` rejects with ``TypeError``.
    """
    name = _check_name(name)
    module = module or load(name)
    cfg = module.Config
    clash = {f.name for f in dataclasses.fields(cfg)} & set(RESERVED_OPTIONS)
    if clash:
        raise TypeError(f"{module.__name__}.Config field {sorted(clash)[0]!r} clashes with a "
                        f"runner option; reserved: {', '.join(RESERVED_OPTIONS)}.")

    def invocation(config, out=Path("runs"), plot=True):
        return Invocation(config, out, plot)

    # Annotations set here, not written in the signature: the Config class is a local
    # (``from __future__ import annotations`` would turn the hint into an unresolvable string).
    invocation.__annotations__ = {"config": Annotated[cfg, tyro.conf.OmitArgPrefixes],
                                  "out": Path, "plot": bool, "return": Invocation}
    invocation.__doc__ = """Run the study.

    Args:
      config: the study's options.
      out: results go to OUT/NAME/<timestamp>/.
      plot: write the PNG plots (--no-plot skips them).
    """
    return tyro.cli(invocation, args=list(argv), prog=f"fmtkit study {name}",
                    description=module.__doc__)


# ---------------------------------------------------------------------------------------------
# Running


def run_study(name: str, config: Any = None, *, out_root: str | Path = "runs",
              plot: bool = True, progress: Progress | None = None) -> tuple[Path, dict]:
    """Runs a study and writes its results folder.

    Args:
      name: a registered study name (``STUDIES``).
      config: the study's ``Config`` (default: ``Config()``).
      out_root: results go to ``out_root/name/<timestamp>/``.
      plot: also write the study's PNG plots (if it has a ``plot``).
      progress: progress-bar factory passed to ``run`` (default: tqdm when stderr is a TTY).

    Returns:
      ``(folder, record)``: the run folder and the record written to ``results.json``
      (keys ``study, config, env, timing, results, plots``).

    Raises:
      ValueError: unknown study; TypeError: ``config`` is not the study's ``Config``.

    Example:
      >>> folder, record = run_study("rounding", out_root="/tmp/runs")  # doctest: +SKIP
    """
    name = _check_name(name)
    module = load(name)
    if config is None:
        config = module.Config()
    if not isinstance(config, module.Config):
        raise TypeError(f"config must be a {module.__name__}.Config, got "
                        f"{type(config).__name__}.")
    if excess_precision_allowed():
        warnings.warn(
            f"XLA_FLAGS lacks {EXACT_LOW_PRECISION_FLAG}: XLA may keep bf16/fp16 "
            "intermediates in f32 inside jit, skipping roundings the study measures, and the "
            "numbers differ from the fmtkit CLI's. Call "
            "studies.app.cli.exact_low_precision_flags() "
            "before JAX starts (results.json records env.xla_allow_excess_precision).",
            stacklevel=2)
    progress = progress or make_progress()
    run_kwargs = {}
    if "progress" in inspect.signature(module.run).parameters:
        run_kwargs["progress"] = progress

    t0 = time.perf_counter()
    results = module.run(config, **run_kwargs)
    t_run = time.perf_counter() - t0
    if not isinstance(results, Mapping):
        raise TypeError(f"{module.__name__}.run must return a dict, got "
                        f"{type(results).__name__}.")

    if not distributed.is_primary():  # several processes: files come from process 0 only
        return Path(out_root) / name, {"study": name, "config": config, "results": results,
                                       "plots": [], "timing": {"run_seconds": t_run}}
    folder = run_dir(out_root, name)
    plots: list[Path] = []
    t1 = time.perf_counter()
    if plot and hasattr(module, "plot"):
        plots = [Path(p) for p in module.plot(results, folder)]
    t_plot = time.perf_counter() - t1
    record = {
        "study": name,
        "config": config,
        "env": environment(),
        "timing": {"run_seconds": t_run, "plot_seconds": t_plot},
        "results": results,
        "plots": [p.name for p in plots],
    }
    write_results(folder / "results.json", record)
    return folder, record


def _print_list(file: Any = None) -> None:
    file = file or sys.stdout
    width = max(map(len, STUDIES))
    print("studies (fmtkit study NAME --help for options):", file=file)
    for n, summary in STUDIES.items():
        print(f"  {n.ljust(width)}  {summary}", file=file)


def main(argv: list[str] | None = None) -> int:
    """``fmtkit study --list`` / ``fmtkit study NAME [options]``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    distributed.initialize_from_env()  # a process of `python -m studies.app.launch` (or a host)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fmtkit study NAME [options] | fmtkit study --list", file=sys.stderr)
        _print_list(sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("--list", "-l", "list"):
        _print_list()
        return 0
    name = argv[0]
    try:
        name = _check_name(name)
    except ValueError as e:
        print(f"fmtkit study: error: {e}", file=sys.stderr)
        return 2
    module = load(name)
    try:
        inv = parse_args(name, argv[1:], module)
    except SystemExit as e:  # --help (0) or a bad option (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    except (ValueError, TypeError) as e:
        print(f"fmtkit study {name}: error: {e}", file=sys.stderr)
        return 2
    config = inv.config

    if distributed.is_primary():
        print(f"study {name}: {config}")
    try:
        folder, record = run_study(name, config, out_root=inv.out, plot=inv.plot)
    except (OSError, ValueError) as e:  # bad input found while running, e.g. a --data file
        print(f"fmtkit study {name}: error: {e}", file=sys.stderr)
        return 2
    except StudyError as e:  # an expected failure, e.g. a non-finite loss
        print(f"fmtkit study {name}: failed: {e}", file=sys.stderr)
        return 1
    if not distributed.is_primary():
        return 0
    if hasattr(module, "summarize"):
        print(module.summarize(record["results"]))
    t = record["timing"]
    print(f"\nrun {t['run_seconds']:.2f} s, plots {t['plot_seconds']:.2f} s")
    print(f"wrote {folder / 'results.json'}")
    for p in record["plots"]:
        print(f"wrote {folder / p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
