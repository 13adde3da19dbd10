"""Every name in every public ``__all__`` appears in the API reference (docs/api/*.md).

A name ``module.NAME`` is documented by an entry ``::: module.NAME`` (mkdocstrings renders
its docstring), by the ``heading: "module.NAME"`` of an entry that renders it from where it
is defined (a name loaded lazily), or by a row of a table whose first cell is
``module.NAME`` in backticks (a re-export, a submodule, a deprecated spelling in
docs/deprecated.md). ``make docs`` then fails if an entry cannot be rendered.
"""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ["fmtkit", "fmtkit.fp8", "fmtkit.fp4", "fmtkit.policy", "fmtkit.debug",
                  "fmtkit.optim",
                  "fmtkit.scaling", "fmtkit.casting", "fmtkit.formats", "fmtkit.telemetry",
                  "fmtkit.distributed", "fmtkit.memory", "pallas_kernels", "fmtkit.debuglog",
                  "fmtkit.qwix"]
ENTRY = re.compile(r"^:::\s+([\w.]+)\s*$", re.M)
HEADING = re.compile(r"""^\s+heading:\s*["']([\w.]+)["']\s*$""", re.M)
ROW = re.compile(r"^\|\s*`([\w.]+)`", re.M)


def public_names() -> list[str]:
    """``module.NAME`` for every name of every public module's ``__all__``."""
    # fmtkit.qwix needs the optional dependency qwix (fmtkit[qwix]); without it, its page is
    # still required (test_every_public_module_has_a_page) but its names cannot be listed.
    try:
        importlib.import_module("qwix")
        have_qwix = True
    except ImportError:
        have_qwix = False
    return [f"{mod}.{name}" for mod in PUBLIC_MODULES if have_qwix or mod != "fmtkit.qwix"
            for name in importlib.import_module(mod).__all__]


def documented(pages: list[Path]) -> set[str]:
    """The names the reference pages document (module docstring)."""
    names: set[str] = set()
    for page in pages:
        text = page.read_text()
        names |= set(ENTRY.findall(text)) | set(HEADING.findall(text)) | set(ROW.findall(text))
    return names


def missing_from(docs_dir: Path) -> list[str]:
    pages = [*sorted((docs_dir / "api").glob("*.md")), docs_dir / "deprecated.md"]
    have = documented([p for p in pages if p.exists()])
    return [name for name in public_names() if name not in have]


def test_every_public_name_is_in_the_api_reference():
    missing = missing_from(ROOT / "docs")
    assert not missing, ("not in the API reference (add a `::: NAME` entry to "
                         "docs/api/<module>.md):\n" + "\n".join(missing))


def test_every_public_module_has_a_page():
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("*.md")}
    for mod in PUBLIC_MODULES:
        assert mod.split(".")[-1] in pages, f"docs/api has no page for {mod}"


@pytest.mark.parametrize("victim", ["fmtkit.scaling.quantize", "fmtkit.cast",
                                    "pallas_kernels.quantize_1x128"])
def test_removing_a_name_from_the_reference_fails_the_check(victim, tmp_path):
    """The check above notices a deleted entry (an entry, a re-export row)."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    assert missing_from(docs) == []
    for page in (docs / "api").glob("*.md"):
        text = page.read_text()
        lines = [line for line in text.splitlines(keepends=True)
                 if line.strip() not in (f"::: {victim}",) and
                 not line.startswith(f"| `{victim}`")]
        page.write_text("".join(lines))
    assert missing_from(docs) == [victim]


def test_the_patterns_read_entries_headings_and_rows():
    text = ('::: fmtkit.scaling.qdq\n    options:\n      heading: "fmtkit.policy.X"\n'
            "| `fmtkit.cast` | function |\n| name | kind |\n")
    assert ENTRY.findall(text) == ["fmtkit.scaling.qdq"]
    assert HEADING.findall(text) == ["fmtkit.policy.X"]
    assert ROW.findall(text) == ["fmtkit.cast"]
