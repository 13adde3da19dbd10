"""Docstrings, comments and docs point only to files inside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A path to a markdown note of the developers' notes folder (also under its "shared" parent,
# or their style and design guides) or to the machine the project was written on ("/work/...").
REF = re.compile(r"(?<![\w/.])((?:\.\./)*(?:shared/)?notes/[\w.\-]+\.md|/work/[\w./\-]+"
                 r"|(?:STYLE|DESIGN)\.md)")
SHARED = "sha" + "red"  # spelled in two parts so that searches for such paths skip this file


def _files():
    for pkg in ("fmtkit", "pallas_kernels", "studies", "tests"):
        yield from sorted((ROOT / pkg).rglob("*.py"))
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md", "Makefile",
                                         "pyproject.toml") if (ROOT / name).exists())


def test_no_reference_leaves_the_repository():
    bad = []
    for path in _files():
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for ref in REF.findall(line):
                if ref.startswith("/work/") or not (ROOT / ref).exists():
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not bad, "\n".join(bad)


def test_the_pattern_finds_such_references():
    assert REF.findall(f"see {SHARED}/notes/flax-seams.md and ``notes/pallas-fp8.md``") == [
        f"{SHARED}/notes/flax-seams.md", "notes/pallas-fp8.md"]
    assert REF.findall("a rule of STYLE.md") == ["STYLE.md"]
    assert REF.findall("cd /work/main/.venv") == ["/work/main/.venv"]
    assert REF.findall("docs/notes/x.md is in the repo") == []  # part of a longer path
