"""Runs a study: ``fmtkit study NAME [--option value ...]``, ``fmtkit study --list``.

Each study is a module ``studies/<name with - replaced by _>.py`` (see ``studies._common``
for the protocol: ``Config``, a pure ``run``, optional ``summarize`` and ``plot``). The runner
derives the command-line options from the fields of the study's ``Config``, runs it, writes
``runs/NAME/<timestamp>/results.json`` (config, versions, device, wall times, the numbers) and
the PNG plots, and prints the study's summary table.

Adding a study: write its module and add one line to ``STUDIES`` below.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import time
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from studies._common import (
    Progress,
    StudyError,
    environment,
    make_progress,
    run_dir,
    write_results,
)

__all__ = ["RESERVED_OPTIONS", "STUDIES", "build_parser", "load", "main", "module_name",
           "run_study"]

STUDIES: dict[str, str] = {
    # CLI name: one-line summary.  Module: studies/<name with "-" replaced by "_">.py
    "formats": "range/precision table of every format and a dynamic-range plot",
    "underflow": "small gradients in fp16 directly, with loss scaling (x2^16), and in bf16",
    "master-weights": "1.0 + 1e-3 a thousand times in bf16, fp16, f32 and with f32 masters",
    "loss-scale": "the dynamic loss-scale state machine over a scripted run with overflows",
    "rounding": "fp16 vs bf16 rounding across the range: stored bits, errors, overflow",
    "fp8-outliers": "per-tensor vs row vs 1x128 block vs MX scaling as outlier channels grow",
    "ablate": "the main job: a small LM trained under each precision setup (fmtkit ablate)",
    "allreduce": "gradient all-reduce in bf16 vs f32 vs bf16-comm/f32-sum across 8 devices",
    "accumulation": "FP8 GEMM with a ~14-bit accumulator vs K, with/without promotion every 128",
    "memory": "bytes per parameter per policy/optimizer; activations per layer with/without remat",
    "sensitivity": "lower one module at a time to bf16/fp16/FP8 and rank modules by the damage",
    "router-precision": "top-1 MoE with its router in bf16 vs f32: flips vs an f32 shadow, balance",
    "fp8-recipes": "training loss under each FP8 recipe (incl. 128x128 grad blocks) vs bf16-mixed",
}
"""The registered studies, in ``--list`` order."""

RESERVED_OPTIONS = ("out", "no_plot")
"""Options the runner adds to every study; a ``Config`` must not use these field names."""


def module_name(name: str) -> str:
    """``"fp8-outliers"`` -> ``"studies.fp8_outliers"``."""
    return "studies." + name.replace("-", "_")


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
# Options from the Config dataclass


def _field_help(cls: type) -> dict[str, str]:
    """Per-field help from the ``Attributes:`` section of a Google-style docstring."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    in_attrs, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attrs = True
            continue
        if not in_attrs:
            continue
        if line and not line.startswith(" "):  # next section
            break
        m = re.match(r"^ {2,4}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.strip():
            out[current] += " " + line.strip()
    return out


def _scalar_parser(tp: type, option: str) -> Callable[[str], Any]:
    if tp is str:
        return str
    if tp is bool:
        def parse_bool(s: str) -> bool:
            low = s.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
        return parse_bool
    if tp in (int, float):
        def parse_num(s: str) -> Any:
            try:
                return tp(s)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"invalid {tp.__name__} value: {s!r}") from None
        parse_num.__name__ = tp.__name__
        return parse_num
    raise TypeError(f"{option}: unsupported Config field type {tp!r} (use int, float, str, "
                    "bool, Literal[...], X | None or tuple[X, ...]).")


def _add_field(parser: argparse.ArgumentParser, field: dataclasses.Field, tp: Any,
               help_text: str) -> None:
    option = "--" + field.name.replace("_", "-")
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    if default is dataclasses.MISSING:
        raise TypeError(f"Config field {field.name!r} needs a default (studies run with "
                        "defaults).")
    kw: dict[str, Any] = {"dest": field.name, "default": default, "help": help_text}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{option}: unsupported union type {tp!r}.")
        tp, origin, args = rest[0], typing.get_origin(rest[0]), typing.get_args(rest[0])
    if tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kw["choices"] = list(args)
        kw["type"] = _scalar_parser(type(args[0]), option)
        kw["metavar"] = "{" + ",".join(map(str, args)) + "}"
    elif origin is tuple:
        elems = [a for a in args if a is not Ellipsis]
        if len(set(elems)) != 1:
            raise TypeError(f"{option}: tuple fields must be homogeneous, got {tp!r}.")
        parse_elem = _scalar_parser(elems[0], option)

        def parse_items(s: str) -> tuple[Any, ...]:  # "1e2,1e3" or one item per argument
            return tuple(parse_elem(p) for p in s.split(",") if p.strip())

        parse_items.__name__ = f"{elems[0].__name__} list"
        kw["type"] = parse_items
        kw["nargs"] = "+" if Ellipsis in args else len(args)
        kw["metavar"] = elems[0].__name__.upper()
    else:
        kw["type"] = _scalar_parser(tp, option)
        kw["metavar"] = tp.__name__.upper()
    parser.add_argument(option, **kw)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    pass


def build_parser(name: str, module: types.ModuleType | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``fmtkit study NAME``: one option per ``Config`` field.

    Field ``n_steps: int = 100`` becomes ``--n-steps INT``; ``bool`` fields become
    ``--flag / --no-flag``; ``tuple[float, ...]`` fields take one or more values (spaces or
    commas); ``Literal[...]`` fields list their choices; ``X | None`` fields take an X.
    """
    name = _check_name(name)
    module = module or load(name)
    cfg = module.Config
    hints = typing.get_type_hints(cfg)
    helps = _field_help(cfg)
    parser = argparse.ArgumentParser(
        prog=f"fmtkit study {name}", description=module.__doc__,
        formatter_class=_HelpFormatter)
    for field in dataclasses.fields(cfg):
        if field.name in RESERVED_OPTIONS:
            raise TypeError(f"{module.__name__}.Config field {field.name!r} clashes with a "
                            f"runner option; reserved: {', '.join(RESERVED_OPTIONS)}.")
        _add_field(parser, field, hints[field.name], helps.get(field.name, ""))
    runner = parser.add_argument_group("runner options")
    runner.add_argument("--out", default="runs", type=Path,
                        help="results go to OUT/NAME/<timestamp>/")
    runner.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    return parser


def _config_from_args(cfg: type, ns: argparse.Namespace) -> Any:
    values = {}
    for field in dataclasses.fields(cfg):
        v = getattr(ns, field.name)
        if isinstance(v, list):  # nargs: a list of per-argument tuples -> one flat tuple
            v = tuple(x for part in v for x in (part if isinstance(part, tuple) else (part,)))
        values[field.name] = v
    return cfg(**values)


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
    parser = build_parser(name, module)
    try:
        ns = parser.parse_args(argv[1:])
    except SystemExit as e:  # --help (0) or a bad option (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        config = _config_from_args(module.Config, ns)
    except (ValueError, TypeError) as e:
        print(f"fmtkit study {name}: error: {e}", file=sys.stderr)
        return 2

    print(f"study {name}: {config}")
    try:
        folder, record = run_study(name, config, out_root=ns.out, plot=not ns.no_plot)
    except (OSError, ValueError) as e:  # bad input found while running, e.g. a --data file
        print(f"fmtkit study {name}: error: {e}", file=sys.stderr)
        return 2
    except StudyError as e:  # an expected failure, e.g. a non-finite loss
        print(f"fmtkit study {name}: failed: {e}", file=sys.stderr)
        return 1
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
