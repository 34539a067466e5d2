"""MkDocs hook: a link from a page to a repository file outside docs/ becomes the file's path in plain text on the site.

The pages are read on GitHub as well as on the site; on GitHub `../bench/RESULTS.md` opens the file, on the site it
would be a dead link, which `mkdocs build --strict` rightly refuses. tests/unit/test_docs.py checks that every such
target exists in the repository, so rewriting them here hides no broken link.
"""

from __future__ import annotations

import re

# [text](../path/to/file#anchor): a relative link that leaves docs/ (one or more "../" steps).
_OUTSIDE_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>(?:\.\./)+[^)#\s]+)(?:#[^)\s]*)?\)")


def _plain(match: re.Match[str]) -> str:
    path = re.sub(r"^(?:\.\./)+", "", match.group("target"))
    text = match.group("text")
    return text if text.strip("`") == path else f"{text} (`{path}` in the repository)"


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return _OUTSIDE_LINK.sub(_plain, markdown)
