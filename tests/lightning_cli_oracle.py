"""Lightning's LightningCLI as an oracle where pytorch-lightning is installed without jsonargparse's ``signatures``
extra (docstring-parser, typeshed-client), which its CLI checks for: the check is passed and docstring-parser stands in
as a stub that finds no documentation. Only the help texts differ from a full install; parsing is jsonargparse's own."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from enum import Enum
from typing import Any, Iterator

import pytest


def _docstring_parser_stub() -> types.ModuleType:
    module = types.ModuleType("docstring_parser")
    module.__spec__ = importlib.machinery.ModuleSpec("docstring_parser", None)

    class ParseError(Exception):
        pass

    class Docstring:
        short_description = None
        long_description = None
        params: list[Any] = []

    module.ParseError = ParseError  # type: ignore[attr-defined]
    module.DocstringStyle = Enum("DocstringStyle", "AUTO GOOGLE NUMPYDOC REST EPYDOC")  # type: ignore[attr-defined]
    module.parse = lambda text, style=None: Docstring()  # type: ignore[attr-defined]
    return module


def lightning_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``pytorch_lightning.cli``, importable for the test (skips without pytorch-lightning)."""
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of these rows")
    from lightning_utilities.core.imports import RequirementCache

    real = RequirementCache._check_extras_available
    monkeypatch.setattr(
        RequirementCache,
        "_check_extras_available",
        lambda self, requirement: requirement.name == "jsonargparse" or real(self, requirement),
    )
    if importlib.util.find_spec("docstring_parser") is None:
        monkeypatch.setitem(sys.modules, "docstring_parser", _docstring_parser_stub())
    monkeypatch.delitem(sys.modules, "pytorch_lightning.cli", raising=False)
    yield importlib.import_module("pytorch_lightning.cli")
    sys.modules.pop("pytorch_lightning.cli", None)
