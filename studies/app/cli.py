"""The ``fmtkit`` command line: format tables, number inspection, benchmarks and studies.

An application on top of the library, not part of it: ``fmtkit`` (the core) never imports
this module or ``studies``. The console script ``fmtkit`` and ``python -m studies.app.cli`` run
``main``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

from fmtkit.formats import ALIASES, FORMATS, decompose, get_format
from studies.app.registry import Entry, discover
from studies.lib.common import EXACT_LOW_PRECISION_FLAG

_DEFAULT_INSPECT = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _fmt_num(v: float) -> str:
    if math.isnan(v) or math.isinf(v) or v == 0:
        return str(v)
    return f"{v:.6g}"


def format_table() -> list[dict]:
    """One row per format: the range/precision constants (what ``fmtkit formats`` prints)."""
    rows = []
    for f in FORMATS.values():
        rows.append({
            "name": f.name, "bits": f.bits, "exponent_bits": f.exponent_bits,
            "mantissa_bits": f.mantissa_bits, "bias": f.bias, "max": f.max,
            "min_normal": f.min_normal, "min_subnormal": f.min_subnormal, "eps": f.eps,
            "has_inf": f.has_inf, "has_nan": f.has_nan,
            "has_negative_zero": f.has_negative_zero,
            "aliases": [a for a, n in ALIASES.items() if n == f.name],
        })
    return rows


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _cmd_formats(args: argparse.Namespace) -> int:
    table = format_table()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    yn = {True: "y", False: "-"}
    _print_table(
        ["format", "bits", "E", "M", "bias", "max", "min normal", "min subnormal", "eps",
         "inf", "nan", "-0", "aliases"],
        [[r["name"], str(r["bits"]), str(r["exponent_bits"]), str(r["mantissa_bits"]),
          str(r["bias"]), _fmt_num(r["max"]), _fmt_num(r["min_normal"]),
          _fmt_num(r["min_subnormal"]), _fmt_num(r["eps"]), yn[r["has_inf"]],
          yn[r["has_nan"]], yn[r["has_negative_zero"]], ",".join(r["aliases"])]
         for r in table])
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    names = args.format or list(_DEFAULT_INSPECT)
    fmts = [get_format(n) for n in names]
    rows, records = [], []
    for value in args.values:
        for f in fmts:
            d = decompose(value, f)
            records.append(d.__dict__ | {"bits": d.bits})
            rows.append([repr(d.value), f.name, d.bits, repr(d.stored), d.kind,
                         _fmt_num(d.abs_error), _fmt_num(d.rel_error)])
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        _print_table(["value", "format", "sign exponent mantissa", "stored", "kind",
                      "abs error", "rel error"], rows)
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    from fmtkit.policy import describe_presets

    print(describe_presets())
    return 0


def benchmarks() -> dict[str, Entry]:
    """The benchmarks ``fmtkit bench`` runs, by ``NAME``: every public module of
    ``studies.bench`` (its ``NAME``, ``SUMMARY`` and ``main(argv) -> int``), in name order."""
    return {e.name: e for e in discover("studies.bench")}


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    benches = benchmarks()
    if args.name is None or args.name == "list":
        width = max(map(len, benches))
        print("benchmarks (fmtkit bench NAME --help for options):")
        for e in benches.values():
            print(f"  {e.name.ljust(width)}  {e.summary}")
        return 0
    if args.name not in benches:
        raise SystemExit(f"fmtkit bench: unknown benchmark {args.name!r}; "
                         f"valid: {', '.join(benches)}")
    module = importlib.import_module(benches[args.name].module)
    return int(module.main(rest) or 0)


def exact_low_precision_flags() -> None:
    """Turns off XLA's "excess precision" before the backend starts.

    By default XLA (on CPU) may keep bf16/f16 intermediates in f32 inside ``jit``, so a bf16
    update ``(p + u).astype(f32)`` is not rounded to bf16: the very effect the studies
    measure would vanish. Entry points call this; library code never touches XLA_FLAGS.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {EXACT_LOW_PRECISION_FLAG}".strip()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fmtkit`` console script."""
    exact_low_precision_flags()
    parser = argparse.ArgumentParser(prog="fmtkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("formats", help="range/precision table of every format")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("inspect", help="how a number is stored in each format")
    p.add_argument("values", nargs="+", type=float, help="numbers to inspect, e.g. 0.1 70000")
    p.add_argument("--format", "-f", action="append",
                   help=f"format name or alias (repeatable; default {','.join(_DEFAULT_INSPECT)})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    sub.add_parser("policies", help="the named precision-policy presets and their rules")

    p = sub.add_parser("bench", help="side-by-side benchmarks (fmtkit bench list)")
    p.add_argument("name", nargs="?", help="benchmark name; 'list' lists them")

    # The studies parse their own options (fmtkit study NAME --help).
    sub.add_parser("study", help="run a study (fmtkit study --list)", add_help=False)
    sub.add_parser("ablate", help="the main job: train the small LM under each policy",
                   add_help=False)
    # Parses its own options (fmtkit debug --help).
    sub.add_parser("debug", help="the worst GEMMs of a run's statistics log, plots over steps",
                   add_help=False)

    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "bench":
            return _cmd_bench(args, rest)
        if args.command in ("study", "ablate", "debug"):
            name = {"study": "app.runner", "ablate": "lm.ablate",
                    "debug": "app.debug_report"}[args.command]
            module = importlib.import_module(f"studies.{name}")
            return int(module.main(rest) or 0)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return {"formats": _cmd_formats, "inspect": _cmd_inspect,
                "policies": _cmd_policies}[args.command](args)
    except (ValueError, TypeError) as e:
        print(f"fmtkit {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
