"""A mkdocs hook for the docs build: code blocks render without their test-runner markers.

tests/test_readme.py runs every ```python block of the docs; a block that cannot run opens
with ``# docs-test: skip (REASON)``. That line is for the test, not the reader: this hook
drops it from the page's markdown before it is rendered.
"""

import re

# The marker as tests/test_readme.py reads it (also its older spelling), a whole line.
_MARKER = re.compile(r"^[ \t]*#\s*(?:docs|readme)-test:\s*skip\b.*\n", re.M)


def on_page_markdown(markdown: str, **kwargs) -> str:
    """The page's markdown without ``# docs-test: skip`` lines."""
    return _MARKER.sub("", markdown)
