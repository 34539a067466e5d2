"""The ``phalanx demo``: a tiny character-level transformer trained on a text file shipped with phalanx.

Submodules are imported on first use so that ``import phalanx.demo`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CharDataModule", "CharTransformer", "run_demo"]

_LOCATIONS = {
    "CharDataModule": "phalanx.demo.data",
    "CharTransformer": "phalanx.demo.model",
    "run_demo": "phalanx.demo.run",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
