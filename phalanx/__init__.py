"""phalanx: a PyTorch training framework built around a pluggable distribution Strategy layer."""

# Helpers are imported under private names and nothing else is bound here, so that `dir(phalanx)` and completion
# show the public API only.
import importlib as _importlib
import typing as _typing

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
_SUBPACKAGES = ("accelerators", "callbacks", "loggers", "plugins", "profilers", "strategies", "utilities")

if _typing.TYPE_CHECKING:
    from phalanx.callbacks.callback import Callback
    from phalanx.cohort.cohort import Cohort
    from phalanx.datamodule import DataModule
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer
    from phalanx.utilities.seed import seed_everything


# Lightning's top-level names spelt differently here: ``from phalanx import LightningModule`` says what to use.
_RENAMED = {"LightningModule": "phalanx.TrainingModule", "LightningDataModule": "phalanx.DataModule"}


def __getattr__(name: str) -> "_typing.Any":
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"phalanx.{name}")  # importing binds it in this module's namespace
    module = _PUBLIC.get(name)
    if module is None:
        # Lazy for import time: only a missing name loads the table's helpers.
        from phalanx.utilities.lightning_names import NotOffered, missing_name_error

        table = {lightning: NotOffered(f"{ours} (the same hooks and methods)") for lightning, ours in _RENAMED.items()}
        raise missing_name_error("phalanx", name, table)
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public API and the module's dunders; not the helpers above, nor the internal submodules (``phalanx.module``,
    # ``phalanx.trainer``, ...) that importing the public names binds here.
    dunders = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted({*dunders, *_PUBLIC, *_SUBPACKAGES})


__all__ = ["Callback", "Cohort", "DataModule", "Trainer", "TrainingModule", "__version__", "seed_everything"]
