"""``make docs``'s build command fails on a broken link anchor (a negative control for the
strict build CI runs: a flag such as ``--quiet`` drops warnings before strict mode counts
them, and the site would then build with broken links)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "site", "build", "dist", "*.egg-info",
                              "__pycache__", ".pytest_cache", ".hypothesis", "tests", "studies")


def _docs_command() -> list[str]:
    """The Makefile's docs recipe, with the venv's mkdocs replaced by this Python's."""
    recipe = re.search(r"^docs: .*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    words = [w for w in shlex.split(recipe) if "=" not in w or w.startswith("-")]
    assert words[0].endswith("/bin/mkdocs"), recipe
    return [sys.executable, "-m", "mkdocs", *words[1:]]


@pytest.mark.slow  # two site builds: about 20 s
def test_the_docs_build_fails_on_a_broken_anchor(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    ok = subprocess.run(_docs_command(), cwd=src, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    # The test runner's markers stay out of the rendered code blocks (docs/_ext/hooks.py).
    pages = sorted((src / "site").rglob("*.html"))
    assert pages
    for html in pages:
        text = html.read_text()
        for block in re.findall(r"<pre.*?</pre>", text, re.S):
            assert "docs-test" not in block and "readme-test" not in block, html
        # No anchor, link or tooltip shows a private module path (fmtkit.policy._nnx...).
        private = re.findall(r'(?:id|title|href)="[^"]*\b(?:fmtkit|pallas_kernels)[\w.]*\._\w',
                             text)
        assert not private, (html, private[:3])
    page = src / "docs" / "guides" / "fp8.md"
    page.write_text(page.read_text() + "\nSee [nothing](scaling.md#no-such-section).\n")
    broken = subprocess.run(_docs_command(), cwd=src, capture_output=True, text=True,
                            timeout=300)
    assert broken.returncode != 0
    assert "no-such-section" in broken.stderr


def test_the_hook_drops_skip_markers_only():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    page = ("```python\n# docs-test: skip (needs a GPU)\nx = 1\n```\n"
            "Mark a block with `# docs-test: skip (REASON)`.\n")
    assert hooks.on_page_markdown(page) == (
        "```python\nx = 1\n```\nMark a block with `# docs-test: skip (REASON)`.\n")


@pytest.mark.slow  # griffe reads the whole package: about a second
def test_a_public_constant_of_a_private_value_renders_its_value():
    # fmtkit.fp8.PARTIALS_BUDGET_BYTES is the default of a private switch: the page shows
    # the number, not the private name it is read from (docs/_ext/public_paths.py); a value
    # naming nothing private renders as written.
    import griffe

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import public_paths
    finally:
        sys.path.pop(0)
    pkg = griffe.load("fmtkit", search_paths=[str(ROOT)])
    budget = pkg["_lowp.gemm.PARTIALS_BUDGET_BYTES"].value
    assert str(budget) == "Switches.partials_budget_bytes"
    assert str(public_paths._public_value(budget)) == "32 * 2 ** 20"
    scope = pkg["_lowp.gemm.WIDENED_SCOPE"].value
    assert public_paths._public_value(scope) is scope
