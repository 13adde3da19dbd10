"""A griffe extension for the docs build: fmtkit's docstrings head their doctests "Example:".

Google style allows "Example:" and "Examples:"; griffe parses only "Examples:" as an examples
section (doctest lines become code blocks) and renders "Example:" as an admonition, where a
doctest reads as prose (``params["kernel"]`` even as a broken markdown link). This extension
renames the heading before griffe parses the docstring, so the source keeps its spelling.
"""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Reads an ``Example:`` section heading as ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and "Example:" in obj.docstring.value:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
