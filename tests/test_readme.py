"""Every ```python block of README.md runs, so the examples stay true.

Each block runs on its own, in a fresh namespace, from the repository root, under the
default (standard) dtype promotion a user has (the suite's strict mode is for fmtkit's own
code). A block opts out only with a first line ``# readme-test: skip (REASON)``, the
reason in the parentheses; the test fails on a skip marker without a reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"^#\s*readme-test:\s*skip\b\s*(\((?P<reason>[^)]*)\))?")


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


BLOCKS = _python_blocks(README.read_text())


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3
    assert _python_blocks("x\n```python\na = 1\n```\n```bash\nls\n```\n") == [(2, "a = 1\n")]


@pytest.mark.slow  # about 90 s for all blocks on a 2-core CPU (eager model code)
@pytest.mark.parametrize("start, code", BLOCKS, ids=[f"README.md:{s}" for s, _ in BLOCKS])
def test_readme_block_runs(start, code, monkeypatch):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    marker = SKIP.match(first)
    if marker:
        assert marker.group("reason") and marker.group("reason").strip(), (
            f"README.md:{start}: a skipped block must say why: "
            "# readme-test: skip (REASON)")
        pytest.skip(f"README.md:{start}: {marker.group('reason')}")
    monkeypatch.chdir(README.parent)
    namespace = {"__name__": f"readme_block_{start}"}
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(code, f"README.md:{start}", "exec"), namespace)
