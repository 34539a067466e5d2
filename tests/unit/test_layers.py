"""Run-time imports only go down the layers, and the packages of phalanx/ import each other without a cycle.

Function-level imports count (they run as soon as the function does); ``if TYPE_CHECKING`` imports do not. The root
package ``phalanx/__init__.py`` is the public facade above every layer, so it is left out of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import phalanx

ROOT = Path(phalanx.__file__).parent

#: package -> the phalanx packages it must never import at run time ("*": every other phalanx package)
FORBIDDEN = {
    "utilities": ("*",),
    "accelerators": ("strategies", "trainer", "cohort", "callbacks", "profilers"),
    "plugins": ("strategies", "trainer", "cohort", "callbacks", "profilers"),
    "strategies": ("trainer", "cohort", "callbacks", "profilers"),
    "cohort": ("trainer",),
    # Profilers sit beside the callbacks: the Trainer drives them, and they know nothing of what they time.
    "profilers": ("accelerators", "plugins", "strategies", "trainer", "cohort", "callbacks"),
}

# The TrainingModule is split over top-level files that import each other; they are one node of the graph.
GROUPS = {"module_clipping": "module", "module_loading": "module", "module_toggling": "module"}

#: (file, imported module) edges allowed for now despite the rules: none.
PENDING_ELSEWHERE: set[tuple[str, str]] = set()


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def run_time_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The phalanx modules ``source`` (the module named ``module``) imports at run time, relative imports resolved."""
    found: list[str] = []

    def visit(node: ast.AST, type_checking_only: bool) -> None:
        if isinstance(node, ast.Import) and not type_checking_only:
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not type_checking_only:
            target = node.module or ""
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{alias.name}" for alias in node.names] if target == "phalanx" else [target]
            found.extend(names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking_only or _is_type_checking_block(node))

    visit(ast.parse(source), False)
    return [name for name in found if name == "phalanx" or name.startswith("phalanx.")]


def package_of(module: str) -> str:
    """The node of the graph a phalanx module belongs to: its top-level package (or top-level module)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "phalanx"
    return GROUPS.get(top, top)


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The run-time imports in ``source`` that break a rule of FORBIDDEN."""
    banned = FORBIDDEN.get(package_of(module), ())
    own = package_of(module)
    return [
        name
        for name in run_time_imports(source, module, is_package)
        if package_of(name) not in (own, "phalanx") and ("*" in banned or package_of(name) in banned)
    ]


def _modules() -> list[tuple[Path, str]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((path, ".".join(parts)))
    return found


def _pending(path: Path, name: str) -> bool:
    return (path.relative_to(ROOT).as_posix(), name) in PENDING_ELSEWHERE


@pytest.mark.parametrize("path, module", _modules(), ids=[module for _, module in _modules()])
def test_run_time_imports_only_go_down(path: Path, module: str) -> None:
    found = forbidden_imports(path.read_text(), module, path.name == "__init__.py")
    assert [name for name in found if not _pending(path, name)] == []


def package_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the package graph ``edges`` (package -> packages it imports), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_packages_import_each_other_without_a_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for path, module in _modules():
        source = package_of(module)
        for name in run_time_imports(path.read_text(), module, path.name == "__init__.py"):
            target = package_of(name)
            if "phalanx" not in (source, target) and source != target and not _pending(path, name):
                edges.setdefault(source, set()).add(target)
    assert package_cycle(edges) == []


RULE_CASES = [
    # (module the source belongs to, source, flagged)
    ("phalanx.utilities.apply", "from phalanx.strategies.strategy import Strategy", True),
    ("phalanx.utilities.apply", "def f():\n    from phalanx.plugins.io import checks", True),
    ("phalanx.utilities.apply", "from .rank_zero import rank_zero_warn", False),
    ("phalanx.accelerators.cpu", "import phalanx.strategies.ddp", True),
    ("phalanx.accelerators.cpu", "from phalanx.utilities.registry import Registry", False),
    ("phalanx.plugins.io.checks", "def f():\n    from phalanx.trainer.checkpoint import x", True),
    ("phalanx.plugins.io.checks", "from ...callbacks import Callback", True),
    ("phalanx.plugins.io.checks", "from phalanx import cohort", True),
    ("phalanx.strategies.resolve", "from phalanx.trainer.argument_checks import shown", True),
    ("phalanx.strategies.resolve", "from phalanx.callbacks.callback import Callback", True),
    ("phalanx.strategies.resolve", "from phalanx.plugins.io.checkpoint_io import CheckpointIO", False),
    ("phalanx.cohort.cohort", "def f():\n    from phalanx.trainer.setup import resolve_strategy", True),
    ("phalanx.cohort.cohort", "from phalanx.strategies.resolve import resolve_strategy", False),
    (
        "phalanx.cohort.cohort",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phalanx.trainer import T",
        False,
    ),
    ("phalanx.cohort.cohort", "from phalanx.trainer_tools import x", False),  # only shares the first letters
]


@pytest.mark.parametrize("module, source, flagged", RULE_CASES)
def test_the_rules_flag_what_they_must(module: str, source: str, flagged: bool) -> None:
    assert bool(forbidden_imports(source, module)) is flagged


CYCLE_CASES = [
    ({"a": {"b"}, "b": {"c"}}, False),
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
]


@pytest.mark.parametrize("edges, has_cycle", CYCLE_CASES)
def test_the_cycle_check_finds_a_cycle(edges: dict[str, set[str]], has_cycle: bool) -> None:
    assert bool(package_cycle(edges)) is has_cycle
