"""The Trainer's package stays readable: no module over 500 lines (trainer.py at most 450), no function body over 60
lines (its docstring not counted). Read with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "phalanx" / "trainer"
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_LINES = {"trainer.py": 450}


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = function.body
    first = body[0]
    if len(body) > 1 and isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1


def test_the_package_is_found():
    assert {"trainer.py", "arguments.py", "logged_metrics.py", "fit_loop.py"} <= {path.name for path in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_module_and_function_sizes(path: Path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_LINES.get(path.name, 500)
    long = [
        f"{node.name} (line {node.lineno}): {_body_lines(node)} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60
    ]
    assert not long, f"{path.name}: functions over 60 lines: {long}"
