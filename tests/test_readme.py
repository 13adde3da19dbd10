"""Every ```python block of the README and of the docs site (docs/**/*.md) runs, so the
examples stay true; the README keeps its set-up commands at the top and its length.

Each block runs on its own, in a fresh namespace, from the repository root, under the
default (standard) dtype promotion a user has (the suite's strict mode is for fmtkit's own
code). A block opts out only with a first line ``# docs-test: skip (REASON)`` (or the older
``# readme-test: skip (REASON)``), the reason in the parentheses; the test fails on a skip
marker without a reason. A block that only includes an example script
(``--8<-- "examples/NAME.py"``) is run by tests/examples/test_examples.py instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SKIP = re.compile(r"^#\s*(?:docs|readme)-test:\s*skip\b\s*(\((?P<reason>[^)]*)\))?")
SNIPPET = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"$')


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the opening fence, code)`` of every ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [(page.relative_to(ROOT).as_posix(), start, code)
          for page in PAGES for start, code in _python_blocks(page.read_text())]


def _included_scripts(code: str) -> list[str] | None:
    """The files a block only includes (``--8<-- "path"`` lines), or None for real code."""
    lines = [line.strip() for line in code.splitlines() if line.strip()]
    matches = [SNIPPET.match(line) for line in lines]
    if lines and all(matches):
        return [m.group("path") for m in matches]
    return None


def test_the_readme_and_the_docs_have_python_blocks():
    assert sum(where == "README.md" for where, _, _ in BLOCKS) >= 1
    assert sum(where.startswith("docs/") for where, _, _ in BLOCKS) >= 10
    assert _python_blocks("x\n```python\na = 1\n```\n```bash\nls\n```\n") == [(2, "a = 1\n")]
    assert _included_scripts('--8<-- "examples/a.py"\n') == ["examples/a.py"]
    assert _included_scripts('--8<-- "examples/a.py"\nprint(1)\n') is None


def test_the_readme_starts_with_the_two_setup_commands_and_stays_short():
    """The two commands that do all the set-up on a fresh machine come first, and both are
    Makefile targets; the README points onward instead of growing."""
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [
        ["make", "ablate"], ["make", "test"]]
    assert text.index("```bash") < text.index("\n## ")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^ablate: \$\(STAMP\)", makefile, re.M)
    assert re.search(r"^test: \$\(STAMP\)", makefile, re.M)
    assert len(text.splitlines()) <= 150


@pytest.mark.parametrize("where, start, code", [b for b in BLOCKS if _included_scripts(b[2])],
                         ids=[f"{w}:{s}" for w, s, c in BLOCKS if _included_scripts(c)])
def test_an_included_example_is_a_tested_script(where, start, code):
    for path in _included_scripts(code):
        assert path.startswith("examples/") and path.endswith(".py"), (
            f"{where}:{start}: includes {path}; only examples/*.py are run elsewhere")
        assert (ROOT / path).is_file(), f"{where}:{start}: {path} does not exist"


@pytest.mark.slow  # a few minutes for all blocks on a 2-core CPU (eager model code, training)
@pytest.mark.parametrize("where, start, code",
                         [b for b in BLOCKS if not _included_scripts(b[2])],
                         ids=[f"{w}:{s}" for w, s, c in BLOCKS if not _included_scripts(c)])
def test_docs_block_runs(where, start, code, monkeypatch):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    marker = SKIP.match(first)
    if marker:
        assert marker.group("reason") and marker.group("reason").strip(), (
            f"{where}:{start}: a skipped block must say why: # docs-test: skip (REASON)")
        pytest.skip(f"{where}:{start}: {marker.group('reason')}")
    if re.search(r"^\s*(import qwix|from (qwix|fmtkit\.qwix) import)", code, re.M):
        pytest.importorskip("qwix")  # the optional dependency of fmtkit.qwix (fmtkit[qwix])
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": f"docs_block_{start}"}
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(code, f"{where}:{start}", "exec"), namespace)
