"""The guides link the API names they use to their reference entries, and each reference
page names its guide (tests/test_api_reference.py checks the latter).

A guide that writes a public name in code (```with_policy(...)```, ```fp8.update_state```,
```fmtkit.debug.capture```) must link it at least once to its entry with an mkdocs-autorefs
cross-reference, ``[`with_policy`][fmtkit.policy.with_policy]``; the strict docs build then
fails if the entry moves. Bare names that read as something else in prose (``init``,
``config``) count only in their qualified form.
"""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path

import pytest
from test_api_reference import PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [*sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "docs" / "getting-started.md"]
# Bare names too generic to mean the API entry on their own.
GENERIC = {"init", "config", "Rule", "Recipe", "compare", "capture", "cast", "RECIPES",
           "get_recipe", "dequantize", "dot_general_fn", "dot_general", "ledger",
           "STATS", "TENSORS"}


@cache
def targets() -> dict[str, str]:
    """The spellings prose uses for a public name -> its reference identifier."""
    defined: dict[str, list[str]] = {}
    spellings: dict[str, str] = {}
    for mod in PUBLIC_MODULES:
        if mod == "fmtkit":
            continue
        for name in importlib.import_module(mod).__all__:
            ident = f"{mod}.{name}"
            spellings[ident] = ident
            spellings[f"{mod.split('.')[-1]}.{name}"] = ident
            defined.setdefault(name, []).append(ident)
    for name, idents in defined.items():
        if len(idents) == 1 and name not in GENERIC:
            spellings[name] = idents[0]
    fmtkit = importlib.import_module("fmtkit")
    for name in fmtkit.__all__:  # fmtkit.cast -> fmtkit.casting.cast
        obj = getattr(fmtkit, name)
        home = getattr(obj, "__module__", "") or ""
        for ident in defined.get(name, []):
            if home.startswith(ident.rsplit(".", 1)[0]) or len(defined[name]) == 1:
                spellings[f"fmtkit.{name}"] = ident
    return spellings


_FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
_SPAN = re.compile(r"(?<![\[`])`([A-Za-z_][\w.]*)(\([^`]*\))?`(?!\])")


def prose(text: str) -> str:
    """The text without code blocks and headings."""
    text = _FENCE.sub("", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def mentioned(text: str) -> set[str]:
    spell = targets()
    return {spell[m.group(1)] for m in _SPAN.finditer(prose(text)) if m.group(1) in spell}


def linked(text: str) -> set[str]:
    spell = targets()
    return {spell.get(ident, ident) for ident in re.findall(r"\]\[([\w.]+)\]", text)}


def unlinked(text: str) -> set[str]:
    return mentioned(text) - linked(text)


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_a_guide_links_the_api_names_it_uses(guide):
    missing = unlinked(guide.read_text())
    assert not missing, (f"{guide.name} names these without linking them once, as "
                         f"[`name`][identifier]: {sorted(missing)}")


def test_an_unlinked_name_fails_the_check():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    assert not unlinked(text)
    unlinked_text = text.replace("[`with_policy`][fmtkit.with_policy]", "`with_policy`")
    assert unlinked(unlinked_text) == {"fmtkit.policy.with_policy"}
    assert mentioned("Call `fp8.update_state(s, o)` and `debug.capture`; `init` alone.") == {
        "fmtkit.fp8.update_state", "fmtkit.debug.capture"}
