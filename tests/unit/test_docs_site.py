"""The documentation site's table of contents and the links between pages: checked without importing mkdocs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
# A nav entry of mkdocs.yml: "  - Title: page.md" (or "  - page.md").
NAV_ENTRY = re.compile(r"^\s*-\s+(?:[^:]+:\s+)?(?P<page>\S+\.md)\s*$")
# A Markdown link or image target, without its title: [text](target "title").
LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
PAGES_WITH_LINKS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "tests" / "README.md",
    *sorted(DOCS.rglob("*.md")),
]


def nav_pages() -> list[str]:
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index("nav:")
    return [match.group("page") for line in lines[start + 1 :] if (match := NAV_ENTRY.match(line))]


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    nav = nav_pages()
    assert len(nav) == len(set(nav)), (
        f"pages listed twice in mkdocs.yml's nav: {sorted(p for p in nav if nav.count(p) > 1)}"
    )
    assert not pages - set(nav), f"docs pages missing from mkdocs.yml's nav: {sorted(pages - set(nav))}"
    assert not set(nav) - pages, f"mkdocs.yml's nav names pages that do not exist: {sorted(set(nav) - pages)}"


def _fenced_code_removed(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


@pytest.mark.parametrize("page", PAGES_WITH_LINKS, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file_in_the_repository(page):
    assert page.is_file(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for match in LINK.finditer(_fenced_code_removed(page.read_text())):
        target = match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() or not path.is_relative_to(ROOT):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to files that are not in the repository: {broken}"
