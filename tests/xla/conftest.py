"""The XLA tier: runs only where torch_xla imports with this torch (its own virtual environment, see the README).

In the main suite (another torch release, no torch_xla) every test here is reported as skipped, with the reason.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch


def _why_no_xla() -> str | None:
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla is not installed (the XLA tier runs in its own virtual environment: see the README)"
    xla_version = importlib.metadata.version("torch_xla")
    if xla_version.split(".")[:2] != torch.__version__.split(".")[:2]:
        return f"torch_xla {xla_version} does not pair with torch {torch.__version__} (they must share X.Y)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _why_no_xla()
    if reason is None:
        return
    for item in items:
        if "tests/xla/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))
