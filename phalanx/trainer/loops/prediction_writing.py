"""What the predict loop keeps for ``BasePredictionWriter`` callbacks: the dataset indices of each batch, recorded as
the loader draws them, and this process's own outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, Sampler

from phalanx.callbacks.prediction_writer import BasePredictionWriter
from phalanx.data.distributed import with_batch_sampler, with_sampler
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class BatchIndexRecorder(Sampler):
    """A batch sampler that passes on another's batches and keeps, for the current pass, the indices of each."""

    def __init__(self, inner: Any, batched: bool) -> None:
        self.inner = inner
        self.batched = batched
        #: The index lists drawn so far in the current pass (workers draw ahead of the batches the loop receives).
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[Any]:
        seen: list[list[int]] = []
        self.seen = seen
        for item in self.inner:
            seen.append([int(index) for index in item] if self.batched else [int(item)])
            yield item

    def __len__(self) -> int:
        return len(self.inner)


def writers(trainer: Trainer) -> list[BasePredictionWriter]:
    """The Trainer's prediction writers."""
    return [callback for callback in trainer.callbacks if isinstance(callback, BasePredictionWriter)]


def record_batch_indices(dataloader: Any) -> Any:
    """``dataloader`` rebuilt to record its batches' dataset indices (a :class:`BatchIndexRecorder`), as Lightning's
    predict loop does for its writers; unchanged, with a warning, where that cannot be done."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        rank_zero_warn(
            f"Couldn't infer the batch indices fetched from your dataloader: {type(dataloader).__name__} (the"
            " prediction writers receive none); indices need a torch DataLoader over a map-style dataset."
        )
        return dataloader
    batched = dataloader.batch_sampler is not None
    recorder = BatchIndexRecorder(dataloader.batch_sampler if batched else dataloader.sampler, batched)
    try:
        # Without automatic batching (batch_size=None) the sampler's single indices are the "batches".
        return with_batch_sampler(dataloader, recorder) if batched else with_sampler(dataloader, recorder)
    except ValueError as error:
        rank_zero_warn(f"Couldn't infer the batch indices fetched from your dataloader: {error}")
        return dataloader


def _recorder(dataloader: Any) -> BatchIndexRecorder | None:
    # A strategy's device-side wrapper (XLA's) keeps the DataLoader it wraps as `.dataloader`.
    inner = getattr(dataloader, "dataloader", dataloader)
    for found in (getattr(inner, "batch_sampler", None), getattr(inner, "sampler", None)):
        if isinstance(found, BatchIndexRecorder):
            return found
    return None


class PredictionRecord:
    """The batch indices and outputs of one predict run, kept for the writers of ``trainer`` (none: keeps nothing).

    ``trainer._run.predict_batch_indices`` holds the current batch's indices, ``predict_epoch_batch_indices`` every
    batch's per dataloader, and ``predict_outputs`` this process's outputs per dataloader (on the CPU), which the
    writers read in ``on_predict_batch_end`` and ``on_predict_epoch_end``.
    """

    def __init__(self, trainer: Trainer, num_dataloaders: int) -> None:
        found = writers(trainer)
        self.on_batch = any(writer.interval.on_batch for writer in found)
        self.on_epoch = any(writer.interval.on_epoch for writer in found)
        self._run = trainer._run
        self._run.predict_batch_indices = []
        self._run.predict_epoch_batch_indices = [[] for _ in range(num_dataloaders)]
        self._run.predict_outputs = [[] for _ in range(num_dataloaders)]
        self._recorder: BatchIndexRecorder | None = None

    @property
    def active(self) -> bool:
        return self.on_batch or self.on_epoch

    def start_dataloader(self, dataloader: Any) -> None:
        self._recorder = _recorder(dataloader) if self.active else None

    def before_batch(self, batch_idx: int, dataloader_idx: int) -> None:
        """Note the dataset indices of batch ``batch_idx`` (drawn by now, as the loader has yielded it)."""
        if self._recorder is None or batch_idx >= len(self._recorder.seen):
            return
        indices = self._recorder.seen[batch_idx]
        if self.on_epoch:
            self._run.predict_epoch_batch_indices[dataloader_idx].append(indices)
        if self.on_batch:
            self._run.predict_batch_indices = indices

    def after_batch(self, output: Any, dataloader_idx: int) -> None:
        if self.on_epoch:
            self._run.predict_outputs[dataloader_idx].append(apply_to_tensors(output, lambda t: t.detach().cpu()))

    def finish(self) -> None:
        """Forget the run's indices and outputs once the writers have had them, as Lightning does."""
        self._run.predict_epoch_batch_indices = []
        self._run.predict_outputs = []


__all__ = ["BatchIndexRecorder", "PredictionRecord", "record_batch_indices", "writers"]
