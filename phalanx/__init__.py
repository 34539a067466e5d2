"""phalanx: a PyTorch training framework built around a pluggable distribution Strategy layer."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names load on first use (PEP 562), so `phalanx --help` and tools that only read the version never import torch.
_PUBLIC = {
    "Callback": "phalanx.callbacks.callback",
    "Cohort": "phalanx.cohort.cohort",
    "DataModule": "phalanx.datamodule",
    "Trainer": "phalanx.trainer.trainer",
    "TrainingModule": "phalanx.module",
    "seed_everything": "phalanx.utilities.seed",
}

# Subpackages reachable as attributes, as Lightning users write them: ``phalanx.callbacks.ModelCheckpoint(...)``.
_SUBPACKAGES = ("accelerators", "callbacks", "loggers", "plugins", "strategies", "utilities")

if TYPE_CHECKING:
    from phalanx.callbacks.callback import Callback
    from phalanx.cohort.cohort import Cohort
    from phalanx.datamodule import DataModule
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer
    from phalanx.utilities.seed import seed_everything


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"phalanx.{name}")  # importing binds it in this module's namespace
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})


__all__ = ["Callback", "Cohort", "DataModule", "Trainer", "TrainingModule", "__version__", "seed_everything"]
