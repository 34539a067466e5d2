"""Every ``phalanx...`` import path that README.md and docs/ show resolves, so moving a module cannot break the docs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A dotted name in backticks (`phalanx.strategies.RunSettings`, `phalanx.utilities.rank_zero.use_thread_rank(rank)`).
_DOTTED = re.compile(r"`(phalanx(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# An import statement (in code blocks or prose): `from phalanx.strategies import DDPStrategy, FSDPStrategy`.
_FROM_IMPORT = re.compile(r"from (phalanx(?:\.[A-Za-z_][A-Za-z0-9_]*)*) import (\([^)]*\)|[A-Za-z_][A-Za-z0-9_, ]*)")


def _documented_paths() -> list[str]:
    paths: set[str] = set()
    for document in DOCUMENTS:
        text = document.read_text()
        paths.update(_DOTTED.findall(text))
        for module, names in _FROM_IMPORT.findall(text):
            names = names.strip("()").replace("\n", ",")
            paths.update(f"{module}.{name.split(' as ')[0].strip()}" for name in names.split(",") if name.strip())
    return sorted(paths)


def _resolve(path: str) -> object:
    """Import the longest module prefix of ``path``, then read the rest as attributes."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError as error:
            if error.name is None or not ".".join(parts[:end]).startswith(error.name):
                raise
            continue
        for attribute in parts[end:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(path)


def test_the_docs_show_strategy_paths() -> None:
    paths = _documented_paths()
    assert "phalanx.strategies.FSDPStrategy" in paths
    assert any(path.startswith("phalanx.strategies.xla.") for path in paths)


@pytest.mark.parametrize("path", _documented_paths())
def test_a_documented_path_imports(path: str) -> None:
    assert _resolve(path) is not None, f"{path} is shown in README.md or docs/ but does not resolve"
