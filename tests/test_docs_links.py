"""Docstrings, comments and docs point only to files inside the repository, and the
README's and CONTRIBUTING's relative links reach files that exist (the docs site's own links
and anchors are checked by ``make docs``, which fails on a broken one)."""

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
    for pkg in ("fmtkit", "pallas_kernels", "studies", "tests", "examples", "tools"):
        yield from sorted((ROOT / pkg).rglob("*.py"))
    yield from sorted((ROOT / "docs").rglob("*.md"))
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md",
                                         "Makefile", "pyproject.toml", "mkdocs.yml")
                if (ROOT / name).exists())


# A markdown link or image target: [text](target), without a scheme (http:, mailto:).
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)([^)\s#]+)(?:#[^)\s]*)?\)")


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


def test_the_readme_and_contributing_links_reach_files():
    bad = []
    for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md"):
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            bad += [f"{name}:{n}: {t}" for t in LINK.findall(line) if not (ROOT / t).exists()]
    assert not bad, "\n".join(bad)


def test_the_link_pattern():
    assert LINK.findall("[a](docs/x.md) [b](https://x.org/y) [c](LICENSE#top) [d](#here)") == [
        "docs/x.md", "LICENSE"]
