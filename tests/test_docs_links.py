"""Docstrings, comments and docs point only to files inside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A path to a markdown note of the developers' notes folder (also under its "shared" parent,
# or their style and design guides) or to the machine the project was written on ("/work/...").
REF = re.compile(r"(?<![\w/.])((?:\.\./)*(?:shared/)?notes/[\w.\-]+\.md|/work/[\w./\-]+"
                 r"|(?:STYLE|DESIGN)\.md)")
# The examples below are spelled in parts so that searches for such paths skip this file.
SHARED, NOTE, GUIDE = "sha" + "red", "pallas" + "-fp8.md", "STY" + "LE.md"


def _files():
    for pkg in ("fmtkit", "pallas_kernels", "studies", "tools", "tests"):
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
    assert REF.findall(f"see {SHARED}/notes/{NOTE} and ``notes/{NOTE}``") == [
        f"{SHARED}/notes/{NOTE}", f"notes/{NOTE}"]
    assert REF.findall(f"a rule of {GUIDE}") == [GUIDE]
    assert REF.findall("cd /work/main/.venv") == ["/work/main/.venv"]
    assert REF.findall("docs/notes/x.md is in the repo") == []  # part of a longer path
