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
                  "fmtkit.distributed", "fmtkit.memory", "pallas_kernels", "fmtkit.debug.log",
                  "fmtkit.qwix", "fmtkit.stats"]
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


# --- Each module page is a catalogue -------------------------------------------------------

CATALOGUE_ROW = re.compile(r"^\|[^|\n]*\|\s*\[`[\w.]+`\]\[([\w.]+)\]", re.M)
CATALOGUE_PAGES = [(mod, ROOT / "docs" / "api" / f"{mod.split('.')[-1]}.md")
                   for mod in PUBLIC_MODULES if mod != "fmtkit"]


def catalogue_problems(mod: str, text: str) -> list[str]:
    """What keeps a module page from being a catalogue: a summary table of every public name
    before the entries, the entries in the table's order, a link to the module's guide."""
    problems = []
    table = CATALOGUE_ROW.findall(text)
    entries = [e for e in ENTRY.findall(text) if e != mod]
    if sorted(table) != sorted(f"{mod}.{n}" for n in importlib.import_module(mod).__all__):
        problems.append("the summary table does not list exactly the module's __all__")
    if table != entries:
        problems.append("the entries do not follow the summary table's order")
    first_row = text.find("| [`") if "| [`" in text else text.find("[`")
    first_entry = min((text.find(f"::: {e}\n") for e in entries), default=len(text))
    if not table or first_row > first_entry:
        problems.append("the summary table does not come before the entries")
    if "](../guides/" not in text:
        problems.append("the page names no guide")
    return problems


@pytest.mark.parametrize("mod, page", CATALOGUE_PAGES, ids=[m for m, _ in CATALOGUE_PAGES])
def test_each_module_page_opens_with_a_catalogue(mod, page):
    assert catalogue_problems(mod, page.read_text()) == []


def test_a_page_out_of_catalogue_order_fails_the_check():
    mod, page = "fmtkit.policy", ROOT / "docs" / "api" / "policy.md"
    text = page.read_text()
    swapped = (text.replace("::: fmtkit.policy.with_policy\n", "::: @\n")
               .replace("::: fmtkit.policy.list_presets\n", "::: fmtkit.policy.with_policy\n")
               .replace("::: @\n", "::: fmtkit.policy.list_presets\n"))
    assert catalogue_problems(mod, swapped) == [
        "the entries do not follow the summary table's order"]
    row = next(line for line in text.splitlines() if "[fmtkit.policy.mark_head]" in line)
    assert "the summary table does not list exactly the module's __all__" in (
        catalogue_problems(mod, text.replace(row + "\n", "")))
    assert catalogue_problems(mod, text.replace("](../guides/", "](../elsewhere/")) == [
        "the page names no guide"]
