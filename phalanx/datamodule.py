"""DataModule: the data side of an experiment, packaged with its preparation and splits."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

from phalanx.utilities.hparams import AttributeDict, init_arguments_of_frame

if TYPE_CHECKING:
    import torch


class DataModule:
    """Holds the datasets and builds a dataloader per stage; override the methods you need."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self._hparams = AttributeDict()

    def prepare_data(self) -> None:
        """Download or write data once per node (runs on one process per node, before ``setup``)."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` ('fit', 'validate', 'test' or 'predict') on every process."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` created."""

    def state_dict(self) -> dict[str, Any]:
        """Return state to keep in checkpoints (plain values and tensors only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by ``state_dict``."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it is moved to the device; overrides the module's hook of the same name."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to ``device``; overrides the module's hook of the same name."""
        from phalanx.utilities.apply import move_to_device  # this module stays importable without torch

        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch once it is on the device; overrides the module's hook of the same name."""
        return batch

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` stored."""

    @property
    def hparams(self) -> AttributeDict:
        """Hyper-parameters recorded by ``save_hyperparameters``."""
        return self._hparams

    def save_hyperparameters(self, *names: str, ignore: Sequence[str] | str | None = None) -> None:
        """Record the ``__init__`` arguments (or the names given, or one dict) as hyper-parameters."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        if len(names) == 1 and isinstance(names[0], (Mapping, argparse.Namespace)):
            given = names[0]
            values = dict(vars(given) if isinstance(given, argparse.Namespace) else given)
        else:
            arguments = init_arguments_of_frame(caller) if caller is not None else {}
            values = {name: arguments[name] for name in names} if names else arguments
        self._hparams.update({k: v for k, v in values.items() if k not in ignored})

    # train_dataloader / val_dataloader / test_dataloader / predict_dataloader are looked up by name:
    # define the ones your DataModule provides.
