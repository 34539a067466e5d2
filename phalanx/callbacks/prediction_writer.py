"""BasePredictionWriter: the base of callbacks that write what ``predict`` produces (Lightning's
``BasePredictionWriter``)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from phalanx.callbacks.callback import Callback

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


class WriteInterval(str, Enum):
    """When a prediction writer writes: after each batch, at the end of the epoch, or both."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Subclass it and override ``write_on_batch_end`` and/or ``write_on_epoch_end`` to store predictions.

    Each process writes its own part: with several processes the data is split between them, and each writer sees
    that process's batches, their outputs and the dataset indices they hold (``batch_indices``), so the parts can be
    put back in dataset order; name the files by ``trainer.global_rank``. ``trainer.predict(...,
    return_predictions=False)`` keeps no outputs beyond what the writers need.

    The indices are recorded as the DataLoader draws them (the predict DataLoader is rebuilt around a recording batch
    sampler, as Lightning does); data that is not a torch DataLoader over a map-style dataset has none (a warning
    says so, and the writers receive empty lists).

    Args:
        write_interval: ``"batch"`` (``write_on_batch_end`` after every batch), ``"epoch"``
            (``write_on_epoch_end`` once, with every output of this process) or ``"batch_and_epoch"``.
    """

    def __init__(self, write_interval: Literal["batch", "epoch", "batch_and_epoch"] = "batch") -> None:
        choices = [interval.value for interval in WriteInterval]
        if getattr(write_interval, "value", write_interval) not in choices:
            raise ValueError(f"write_interval={write_interval!r} is not valid; choose one of {choices}.")
        self.interval = WriteInterval(write_interval)

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainingModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's ``prediction``; ``batch_indices`` are the dataset indices of its samples."""
        raise NotImplementedError(f"{type(self).__name__} writes per batch: override write_on_batch_end.")

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: TrainingModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Write this process's ``predictions`` (one list per dataloader when there are several, else the list of
        outputs); ``batch_indices`` holds, per dataloader, the dataset indices of each batch."""
        raise NotImplementedError(f"{type(self).__name__} writes per epoch: override write_on_epoch_end.")

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.interval.on_batch:
            return
        # The predict loop records the indices in the Trainer's run state (phalanx.trainer.loops.prediction_writing).
        batch_indices = trainer._run.predict_batch_indices
        self.write_on_batch_end(trainer, module, outputs, batch_indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self.interval.on_epoch:
            return
        outputs = trainer._run.predict_outputs
        predictions = outputs[0] if len(outputs) == 1 else outputs
        self.write_on_epoch_end(trainer, module, predictions, trainer._run.predict_epoch_batch_indices)


__all__ = ["BasePredictionWriter", "WriteInterval"]
