"""The README and the docs pages read in short paragraphs: none over about 120 words.

A paragraph (or a list item) is counted in words of its rendered text (a link counts as its
text); code blocks, tables, headings and admonition bodies are not prose. Measurement logs
under docs/results/ are exempt.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "guides").glob("*.md"))]
MAX_WORDS = 120
_FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
_ITEM = re.compile(r"^\s*([-*]|\d+\.)\s")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs and list items of a markdown page, each as one string."""
    out = []
    for block in re.split(r"\n\s*\n", _FENCE.sub("", text)):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or lines[0].lstrip().startswith(("|", "#", "!!!", "--8<--", "<!--")) \
                or lines[0].startswith("    "):
            continue
        items: list[list[str]] = [[]]
        for line in lines:
            if _ITEM.match(line) and items[-1]:
                items.append([])
            items[-1].append(line.strip())
        out += [" ".join(item) for item in items]
    return out


def words(paragraph: str) -> int:
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]|\]\([^)]*\)", r"\1", paragraph)
    return len(text.split())


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_no_paragraph_is_over_about_120_words(page):
    long = [f"{words(p)} words: {p[:80]}..." for p in paragraphs(page.read_text())
            if words(p) > MAX_WORDS]
    assert not long, "split these paragraphs:\n" + "\n".join(long)


def test_the_count_sees_a_long_paragraph_and_skips_code():
    long = " ".join(["word"] * 121)
    assert [words(p) for p in paragraphs(f"# T\n\n{long}\n\n```python\n{long}\n```\n")] == [121]
    assert [words(p) for p in paragraphs("- a b\n- [c d](x.md) e\n")] == [3, 4]  # with "-"
