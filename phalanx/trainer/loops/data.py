"""Where each stage's dataloaders come from, how many batches each contributes, and resuming mid-epoch."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sized
from functools import partial
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset

from phalanx.trainer.loops.prediction_writing import record_batch_indices
from phalanx.utilities.checks import is_number
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.seed import sampler_seed, worker_init_fn

if TYPE_CHECKING:
    from phalanx.datamodule import DataModule
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

_STAGE_METHOD = {
    "train": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def validate_limit(name: str, value: Any) -> int | float:
    """Check a ``limit_*_batches`` value: an int >= 0 (batches) or a float in [0, 1] (fraction)."""
    if not is_number(value):
        raise TypeError(f"{name}={value!r} must be an int (number of batches) or a float in [0.0, 1.0] (fraction).")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name}={value} must be >= 0.")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0.0, 1.0] as a fraction, or an int number of batches.")
    return value


def dataloader_length(dataloader: Any) -> int | float:
    """The number of batches ``dataloader`` yields, or ``inf`` when it has no length."""
    if isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset):
        try:
            return len(dataloader)
        except TypeError:
            return math.inf
    if isinstance(dataloader, Sized):
        try:
            return len(dataloader)
        except TypeError:
            return math.inf
    return math.inf


def limited_batches(dataloader: Any, limit: int | float, name: str) -> int | float:
    """Apply a ``limit_*_batches`` value to a dataloader's length."""
    length = dataloader_length(dataloader)
    if limit == 0:
        return 0  # also for data without a length: nothing to take
    if isinstance(limit, int):
        return min(length, limit)
    if limit == 1.0:
        return length
    if math.isinf(length):
        raise ValueError(
            f"{name}={limit} is a fraction, but the dataloader has no length; pass an int number of batches."
        )
    batches = int(length * limit)
    if limit > 0 and batches == 0:
        raise ValueError(f"{name}={limit} of {length} batches is less than one batch; raise it or pass an int.")
    return batches


def empty_data_reason(dataloader: Any, limit: int | float) -> str:
    """Why ``dataloader`` (with ``limit_train_batches=limit``) gives no batch, in words for a warning."""
    if limit == 0:
        return f"limit_train_batches={limit!r}"
    dataset = getattr(dataloader, "dataset", None)
    length = dataloader_length(dataloader)
    if isinstance(dataloader, DataLoader) and not isinstance(dataset, IterableDataset) and isinstance(dataset, Sized):
        size = len(dataset)
        if size == 0:
            return f"the training DataLoader's dataset ({type(dataset).__name__}) is empty"
        if dataloader.drop_last and dataloader.batch_size is not None and size < dataloader.batch_size:
            return (
                f"drop_last=True drops the only, partial batch: the dataset has {size} samples, fewer than"
                f" batch_size={dataloader.batch_size}"
            )
    if length == 0:
        return f"the training data ({type(dataloader).__name__}) has length 0"
    if isinstance(dataloader, Iterator):
        return (
            f"the training data is a {type(dataloader).__name__}, an iterator: it yields its batches once and has"
            " none left; pass a re-iterable object such as a DataLoader"
        )
    return (
        "the training data"
        f" ({type(dataloader).__name__}{' over ' + type(dataset).__name__ if dataset is not None else ''}) yielded"
        " nothing"
    )


def as_dataloader_list(value: Any, stage: str) -> list[Any]:
    """Normalise one dataloader or a list/tuple of them into a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        loaders = list(value)
    elif isinstance(value, dict):
        raise TypeError(f"A dict of dataloaders is not supported for {stage}; pass a list of dataloaders.")
    else:
        loaders = [value]
    for loader in loaders:
        if not isinstance(loader, Iterable):
            raise TypeError(
                f"The {stage} dataloader must be iterable (e.g. a torch DataLoader), got {type(loader).__name__}."
            )
    return loaders


class DataSource:
    """The dataloaders passed to a Trainer method, or the DataModule / TrainingModule methods that make them."""

    def __init__(self, module: TrainingModule, datamodule: DataModule | None, **dataloaders: Any) -> None:
        self.module = module
        self.datamodule = datamodule
        self.dataloaders = dataloaders

    def get(self, stage: str) -> list[Any]:
        """The dataloaders for ``stage`` ('train', 'validate', 'test' or 'predict')."""
        given = self.dataloaders.get(stage)
        if given is not None:
            return as_dataloader_list(given, stage)
        method_name = _STAGE_METHOD[stage]
        for owner in (self.datamodule, self.module):
            if owner is None:
                continue
            method = getattr(owner, method_name, None)
            if method is not None:
                return as_dataloader_list(method(), stage)
        return []

    def defines(self, stage: str) -> bool:
        """Whether dataloaders for ``stage`` are available without building them."""
        if self.dataloaders.get(stage) is not None:
            return True
        method_name = _STAGE_METHOD[stage]
        return any(
            owner is not None and getattr(owner, method_name, None) is not None
            for owner in (self.datamodule, self.module)
        )


def iterate_from(dataloader: Any, skip: int) -> Iterator[Any]:
    """An iterator over ``dataloader`` that has already passed ``skip`` batches, as if they had been consumed.

    A single-process DataLoader over a map-style dataset advances its sampler without loading the skipped samples;
    anything else fetches and discards them, which keeps worker and sampler state exactly as in the original run.
    """
    iterator = iter(dataloader)
    if skip <= 0:
        return iterator
    sampler_iterator = getattr(iterator, "_sampler_iter", None)
    fast = (
        isinstance(dataloader, DataLoader)
        and dataloader.num_workers == 0
        and not isinstance(dataloader.dataset, IterableDataset)
        and sampler_iterator is not None
        and hasattr(iterator, "_num_yielded")
    )
    try:
        if fast:
            for _ in range(skip):
                next(sampler_iterator)
            iterator._num_yielded += skip
            return iterator
        for _ in range(skip):
            next(iterator)
    except StopIteration:
        # Only a resumed run skips batches: the checkpoint was taken further into the epoch than this data reaches.
        raise CheckpointError(
            f"Resuming mid-epoch needs to pass {skip} batches already trained on, "
            f"but the training data ends before that; "
            "resume with the data (and limit_train_batches) the checkpoint was saved with."
        ) from None
    return iterator


def prepare_dataloader(trainer: Trainer, dataloader: Any, training: bool, record: bool = False) -> Any:
    """Shard the data across processes (when the strategy splits data), seed workers, let the strategy wrap it;
    ``record``: rebuild it to record its batches' dataset indices (for prediction writers)."""
    strategy = trainer.strategy
    sampler_kwargs = strategy.distributed_sampler_kwargs
    if sampler_kwargs and trainer.use_distributed_sampler:
        # Lazy for import time: only a run that splits its data across processes loads the sampler wrapping.
        from phalanx.data.distributed import distributed_dataloader

        seed = sampler_seed()
        dataloader = distributed_dataloader(
            dataloader, training=training, seed=seed, pad_evaluation=strategy.traits.pads_evaluation, **sampler_kwargs
        )
    if (
        os.environ.get("PHALANX_SEED_WORKERS") == "1"
        and getattr(dataloader, "num_workers", 0) > 0
        and dataloader.worker_init_fn is None
    ):
        # seed_everything(workers=True): every worker of every rank gets its own reproducible seed.
        dataloader.worker_init_fn = partial(worker_init_fn, rank=trainer.global_rank)
    if record:
        dataloader = record_batch_indices(dataloader)
    return strategy.process_dataloader(dataloader)
