"""DataModule: the data side of an experiment, packaged with its preparation and splits."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Sequence

from phalanx.utilities.checks import is_int_at_least
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
        from phalanx.utilities.apply import move_to_device  # import time: importable without loading torch

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

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> DataModule:
        """A DataModule whose dataloaders wrap the given datasets (each one dataset, a sequence or a dict of them)."""
        if not is_int_at_least(batch_size, 1):
            raise ValueError(f"batch_size={batch_size!r} must be a positive int.")
        if not is_int_at_least(num_workers, 0):
            raise ValueError(f"num_workers={num_workers!r} must be an int >= 0.")
        datamodule = cls(**datamodule_kwargs)
        given = {"train": train_dataset, "val": val_dataset, "test": test_dataset, "predict": predict_dataset}
        for stage, datasets in given.items():
            if datasets is None:
                continue
            # Training data is shuffled, as Lightning does; evaluation and prediction keep the dataset's order.
            build = partial(
                _loaders_of,
                datasets,
                f"{stage}_dataset",
                shuffle=stage == "train",
                batch_size=batch_size,
                num_workers=num_workers,
            )
            setattr(datamodule, f"{stage}_dataloader", build)
        return datamodule


def _loaders_of(datasets: Any, argument: str, *, shuffle: bool, batch_size: int, num_workers: int) -> Any:
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    def loader(dataset: Any) -> DataLoader:
        if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"{argument} must hold torch Datasets (or objects with __getitem__ and __len__), got"
                f" {type(dataset).__name__}."
            )
        # An IterableDataset has no indices to shuffle.
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle and not isinstance(dataset, IterableDataset),
            num_workers=num_workers,
        )

    if isinstance(datasets, Mapping):
        return {key: loader(dataset) for key, dataset in datasets.items()}
    if isinstance(datasets, (list, tuple)):
        return [loader(dataset) for dataset in datasets]
    return loader(datasets)
