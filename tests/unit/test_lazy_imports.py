"""Every function-level import of phalanx's own modules says why it is lazy: import time, or an optional dependency.

A lazy import is a cost (the dependency is hidden from the module's header) that pays for itself only by keeping
``import phalanx`` (or a command) cheap or an optional package optional; one that dodges an import cycle hides a
layering problem instead. The reason goes in a comment on the import's line or on the line above its block of imports,
and names ``import time`` or ``optional``. Parses the sources (AST, tokenize for comments); imports nothing.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"
SOURCES = sorted(PACKAGE.rglob("*.py"))
REASONS = ("import time", "optional")
# ELSEWHERE: path prefixes skipped while another branch rewrites them: none now.
ELSEWHERE: tuple[str, ...] = ()
# PENDING: lazy imports that dodged an import cycle, as (file, imported module); the set only shrinks (a stale entry
# fails the test), and it is empty: the last cycles (plugins/io's file helpers, formats and CheckpointIO) were broken by
# moving one-file reading and writing below them into plugins/io/serialization.py.
PENDING: set[tuple[str, str]] = set()


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, module) of each function-level import of phalanx whose comment gives no reason."""
    comments = {
        token.start[0]: token.string.lower()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    tree = ast.parse(source)
    imports = [
        node
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    ends = {node.end_lineno: node.lineno for node in imports}
    found = set()
    for node in imports:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        names = [name for name in names if name == "phalanx" or name.startswith("phalanx.")]
        if not names or getattr(node, "level", 0):
            continue
        first = node.lineno
        while first - 1 in ends:  # the comment above a block of imports covers the block
            first = ends[first - 1]
        said = comments.get(node.lineno, "") + comments.get(node.end_lineno, "") + comments.get(first - 1, "")
        if not any(reason in said for reason in REASONS):
            found.update((node.lineno, name) for name in names)
    return sorted(found)


def _relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_lazy_imports_say_why(path: Path) -> None:
    name = _relative(path)
    if name.startswith(ELSEWHERE):
        pytest.skip("rewritten on another branch of issue 25")
    missing = [(line, module) for line, module in unexplained(path.read_text()) if (name, module) not in PENDING]
    assert not missing, f"{name}: say why these imports are lazy (import time or optional dependency): {missing}"


def test_the_pending_list_only_shrinks() -> None:
    still = {(_relative(path), module) for path in SOURCES for _, module in unexplained(path.read_text())}
    assert not PENDING - still, f"these imports have their reason now; drop them from PENDING: {PENDING - still}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    from phalanx.module import M\n", 1),
        ("def f():\n    from phalanx.module import M  # circular otherwise\n", 1),
        ("def f():\n    from phalanx.module import M  # lazy for import time\n", 0),
        ("def f():\n    # Optional dependency.\n    from phalanx.a import A\n    from phalanx.b import B\n", 0),
        ("def f():\n    from torch import nn\n", 0),
        ("from phalanx.module import M\n", 0),
    ],
    ids=["bare", "cycle", "same-line", "block", "not-phalanx", "top-level"],
)
def test_the_check_finds_planted_imports(source: str, expected: int) -> None:
    assert len(unexplained(source)) == expected
