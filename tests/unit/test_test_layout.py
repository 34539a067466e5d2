"""The test tree collects in one pytest run: no two test modules share a basename (the tree has no ``__init__.py``
files, so pytest imports each module under its basename and refuses the second with "import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_test_module_basenames_are_unique() -> None:
    modules = [
        path
        for folder in (ROOT / "tests", ROOT / "integrations")
        for path in folder.rglob("test_*.py")
        if ".venv" not in path.parts
    ]
    counts = Counter(path.name for path in modules)
    shared = {
        name: sorted(str(p.relative_to(ROOT)) for p in modules if p.name == name) for name, n in counts.items() if n > 1
    }
    assert modules and not shared, f"rename one of each group (pytest refuses the second): {shared}"
