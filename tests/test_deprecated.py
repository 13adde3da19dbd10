"""Every deprecated spelling the deprecations page lists (docs/deprecated.md) still works and
warns exactly once per use with a ``DeprecationWarning`` naming its replacement; the ones the
changelog says warn once (a module, renamed statistics) stay silent on a later use.

The uses run in a fresh interpreter (tests/deprecated_uses.py), so each is the process's
first whatever other tests ran before. Each spelling's own behaviour is tested beside its
replacement (tests/test_public_api.py, tests/fp8/test_dot.py, tests/debug/test_log.py,
tests/test_telemetry.py, tests/fp4/test_nvfp4_mxfp4.py); this test ties them to the page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "deprecated.md"

# use (a key of deprecated_uses.USES): (the page's row, by the first code span of its first
# cell; what the warning names instead; whether a later use in the process warns again).
EXPECTED: dict[str, tuple[str, str, bool]] = {
    "fmtkit.fp8.FP8Recipe": ("fmtkit.fp8.FP8Recipe", "use fmtkit.fp8.Fp8Recipe", True),
    "fmtkit.fp8.dot_general(recipe)": ("fmtkit.fp8.dot_general(recipe)",
                                       "use fmtkit.fp8.dot_general_fn(recipe)", True),
    "fmtkit.fp8.Fp8DotState": ("fmtkit.fp8.Fp8DotState", "use fmtkit.DelayedScalingState",
                               True),
    "fmtkit.policy.Fp8State": ("fmtkit.policy.Fp8State",
                               "use fmtkit.policy.DelayedScalingVariable", True),
    "fmtkit.debuglog": ("fmtkit.debuglog", "use fmtkit.debug.log", False),
    **{f"NumericsStats.{old}": ("NumericsStats.underflow", f"use NumericsStats.{old}_share",
                                False) for old in ("underflow", "overflow", "nonfinite")},
    **{old: ("fmtkit.fp4.quantization_stats(...)", f"use [{new!r}]", False)
       for old, new in (("saturated_blocks", "saturation_block_share"),
                        ("underflow_blocks", "underflow_block_share"),
                        ("zero_fraction", "underflow_share"))},
}


def page_rows(text: str) -> list[str]:
    """The first code span of the first cell of each row of the page's tables."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|")
        code = re.search(r"`([^`]+)`", cells[1]) if line.startswith("|") else None
        if code:
            rows.append(code.group(1))
    return rows


def unmatched(rows: list[str]) -> list[str]:
    """Rows without a use in ``EXPECTED``, and rows of ``EXPECTED`` not on the page."""
    expected = {row for row, _, _ in EXPECTED.values()}
    return ([f"the page lists {r!r}, which has no use here" for r in rows if r not in expected]
            + [f"{r!r} is not on the page" for r in sorted(expected - set(rows))])


def test_every_row_of_the_page_has_its_uses():
    rows = page_rows(PAGE.read_text())
    assert len(rows) >= 7  # the table was found
    assert unmatched(rows) == []


def test_the_row_check_sees_a_row_without_uses():
    # Negative controls: a row added to the page without a use, a row removed.
    rows = page_rows(PAGE.read_text() + "| `fmtkit.fp8.NewOld` | `fmtkit.fp8.New` | |\n")
    assert unmatched(rows) == ["the page lists 'fmtkit.fp8.NewOld', which has no use here"]
    rows = [r for r in page_rows(PAGE.read_text()) if r != "fmtkit.debuglog"]
    assert unmatched(rows) == ["'fmtkit.debuglog' is not on the page"]


@pytest.mark.slow
def test_each_deprecated_spelling_works_and_warns_once_per_use():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "deprecated_uses.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(runs) == sorted(EXPECTED)
    problems = []
    for use, (_, replacement, again) in EXPECTED.items():
        first, later = runs[use]
        if not (first["same"] and later["same"]):
            problems.append(f"{use}: does not give its replacement's value")
        if len(first["warnings"]) != 1 or not first["warnings"][0].startswith(
                "DeprecationWarning: ") or replacement not in first["warnings"][0]:
            problems.append(f"{use}: first use warns {first['warnings']}, not one "
                            f"DeprecationWarning naming {replacement!r}")
        if later["warnings"] != (first["warnings"] if again else []):
            problems.append(f"{use}: a later use warns {later['warnings']}"
                            f" ({'every use warns once' if again else 'the first use only'})")
    assert not problems, "\n".join(problems)
