"""The public contract says what it takes: few parameters of the extension points and the Trainer are a bare ``Any``.

"Bare" means annotated exactly ``Any`` or ``Any | None``. ``*args``/``**kwargs`` are not counted: they pass through to
the user's hooks (``training_step(*args)``), whose arguments phalanx cannot know. Parses the sources; imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"
MAX_BARE_ANY = 0.05
BARE = {"Any", "Any | None", "None | Any", "Optional[Any]"}
# The public contract: every method of these files (the Strategy and Launcher base classes), the Trainer's constructor
# and every strategy's and accelerator's registration hook.
CONTRACT_FILES = ("strategies/strategy.py", "strategies/parallel.py", "strategies/launchers/launcher.py")
REGISTRATION_HOOKS = {"register_strategies", "register_accelerators"}


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    return [argument for argument in named if argument.arg not in ("self", "cls")]


def bare_any(functions: list[ast.FunctionDef | ast.AsyncFunctionDef]) -> tuple[int, list[str]]:
    """How many parameters the functions have, and 'function(parameter)' for each bare ``Any`` among them."""
    total, bare = 0, []
    for function in functions:
        for parameter in _parameters(function):
            total += 1
            if parameter.annotation is not None and ast.unparse(parameter.annotation) in BARE:
                bare.append(f"{function.name}({parameter.arg}) line {function.lineno}")
    return total, bare


def _functions(path: Path, names: set[str] | None = None) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (names is None or node.name in names)
    ]


def contract_functions() -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    functions = [function for name in CONTRACT_FILES for function in _functions(PACKAGE / name)]
    functions += _functions(PACKAGE / "trainer/trainer.py", {"__init__"})
    for path in sorted(PACKAGE.rglob("*.py")):
        functions += _functions(path, REGISTRATION_HOOKS)
    return functions


def test_the_public_contract_has_few_bare_any() -> None:
    total, bare = bare_any(contract_functions())
    assert total > 100, "the contract's table lost its files"
    assert len(bare) / total <= MAX_BARE_ANY, f"{len(bare)} of {total} parameters are a bare Any: {bare}"


def test_trainer_and_registries_name_their_types() -> None:
    functions = _functions(PACKAGE / "trainer/trainer.py", {"__init__"})
    for path in sorted(PACKAGE.rglob("*.py")):
        functions += _functions(path, REGISTRATION_HOOKS)
    _, bare = bare_any(functions)
    assert not bare


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a: Any, b: int): ...", 1),
        ("def f(a: Any | None = None, b: Any = 1): ...", 2),
        ("def f(self, a: Optional[Any]): ...", 1),
        ("def f(a: list[Any], b: Any | int, c: object): ...", 0),
        ("def f(*args: Any, **kwargs: Any): ...", 0),
    ],
)
def test_the_count_sees_a_bare_any(source: str, expected: int) -> None:
    functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
    assert len(bare_any(functions)[1]) == expected
