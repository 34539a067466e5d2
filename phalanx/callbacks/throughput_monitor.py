"""ThroughputMonitor: batches, samples, items and FLOPs per second (and the MFU) of each stage, logged on rank 0."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from phalanx.callbacks.callback import Callback
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.throughput import Throughput, compute_dtype, get_available_flops

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

# The host clock; a module attribute so that tests can replace it with one they control.
_now: Callable[[], float] = time.perf_counter
_THROUGHPUT_ARGUMENTS = ("window_size", "separator", "available_flops")


class _HostClock:
    """Time points on the host clock."""

    def mark(self) -> Any:
        return _now()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def wait(self, mark: Any) -> None:
        return None


class _CudaClock:
    """Time points as CUDA events, recorded in stream order without waiting; read only when the rates are computed."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, mark: Any) -> None:
        mark.synchronize()  # the marks before it are complete too: one wait per computation, not per batch


@dataclass
class _Record:
    mark: Any
    pauses: int  # the pauses (validation inside fit) recorded before this point
    batches: int
    samples: int
    lengths: int | None
    flops: float | None


@dataclass
class _Stage:
    """One stage's measurement: its start, its running totals, the points not yet turned into seconds."""

    throughput: Throughput
    start: Any = None
    batches: int = 0
    samples: int = 0
    lengths: int = 0
    in_run: int = 0  # batches since this run of the stage started (what log_every_n_steps counts in evaluation)
    last: Any = None  # the mark of the last batch
    pending: deque[_Record] = field(default_factory=deque)  # made with the window's length by setup
    pauses: list[tuple[Any, Any]] = field(default_factory=list)
    paused: list[float] = field(default_factory=lambda: [0.0])  # seconds paused before each pause resolved so far


class ThroughputMonitor(Callback):
    """Logs the throughput of training, validation, test and prediction as Lightning's ``ThroughputMonitor`` does:
    ``{stage}/time``, ``{stage}/batches``, ``{stage}/samples`` (and ``{stage}/lengths``) and, over the last
    ``window_size`` batches, ``{stage}/device/batches_per_sec``, ``.../samples_per_sec``, ``.../items_per_sec``,
    ``.../flops_per_sec`` and ``.../mfu``, with world rates (``{stage}/samples_per_sec``...) when there are several
    devices (see :class:`~phalanx.utilities.throughput.Throughput`); ``stage`` is ``train``, ``validate``, ``test``
    or ``predict``. Measured on rank 0 and logged every ``log_every_n_steps`` optimizer steps (training) or
    batches (evaluation), to the Trainer's loggers; the time left out of training is the time spent validating.

    FLOPs come from a ``flops_per_batch`` attribute of the module, e.g. counted once in ``setup`` with
    :func:`~phalanx.utilities.throughput.measure_flops`; the MFU needs the device's peak, known for common NVIDIA
    GPUs (:func:`~phalanx.utilities.throughput.get_available_flops`) or given as ``available_flops``.

    It adds no host-device synchronisation per batch: time is read on the host clock, or on CUDA as events that are
    waited for only when values are logged. ``batch_size_fn`` and ``length_fn`` run on every batch: keep them to
    shapes (``batch[0].size(0)``), not values read from the device.

    Args:
        batch_size_fn: The number of samples in a batch.
        length_fn: The number of items (tokens...) in a batch, for ``items_per_sec``.
        **kwargs: ``window_size`` (100), ``separator`` ("/") and, beyond Lightning, ``available_flops`` (the peak
            FLOP/s of one device, for the MFU where it is not known or to override it).
    """

    def __init__(
        self, batch_size_fn: Callable[[Any], int], length_fn: Callable[[Any], int] | None = None, **kwargs: Any
    ) -> None:
        unknown = sorted(set(kwargs) - set(_THROUGHPUT_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"ThroughputMonitor got unknown keyword arguments {unknown}; it takes {list(_THROUGHPUT_ARGUMENTS)}."
            )
        if not callable(batch_size_fn) or (length_fn is not None and not callable(length_fn)):
            raise TypeError("ThroughputMonitor: batch_size_fn (and length_fn when given) must be functions of a batch.")
        Throughput(**kwargs)  # refuses a bad window_size here rather than when the first stage starts
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.kwargs = kwargs
        self.available_flops: float | None = kwargs.get("available_flops")
        self._stages: dict[str, _Stage] = {}
        self._module_has_flops: bool | None = None
        self._clock: _HostClock | _CudaClock = _HostClock()

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if self.kwargs.get("available_flops") is None:
            self.available_flops = get_available_flops(device, compute_dtype(str(trainer.precision)))
        self._clock = _CudaClock() if device.type == "cuda" else _HostClock()
        arguments = {name: value for name, value in self.kwargs.items() if name != "available_flops"}
        window = arguments.get("window_size", 100)
        self._stages = {
            name: _Stage(
                Throughput(self.available_flops, trainer.world_size, **arguments), pending=deque(maxlen=window)
            )
            for name in ("train", "validate", "test", "predict")
        }

    # ------------------------------------------------------------------ hooks (rank 0, with a logger)
    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _measures(trainer):
            self._start(trainer, "train")

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, *_: Any) -> None:
        if not _measures(trainer):
            return
        self._update(module, "train", batch)
        # As Lightning: values at the end of an accumulation window (the optimizer step included; the fit loop's own
        # test of a window that goes on), on the steps the Trainer logs at.
        every = trainer.log_every_n_steps
        if trainer.fit_loop._accumulating() or not every:
            return
        if (trainer.fit_loop.batches_stepped + 1) % every == 0 or trainer.should_stop:
            _log(trainer, self._compute("train"), trainer.fit_loop.batches_stepped, epoch=trainer.current_epoch)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _measures(trainer) and not trainer.sanity_checking:
            self._start(trainer, "validate")

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        if _measures(trainer) and not trainer.sanity_checking:
            self._evaluation_batch(trainer, module, "validate", batch)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not _measures(trainer) or trainer.sanity_checking or str(trainer.state.fn) != "fit":
            return
        # Training's clock leaves out the time from its last batch to the end of this validation.
        train = self._stages["train"]
        if train.start is not None:
            train.pauses.append((train.last if train.last is not None else train.start, self._clock.mark()))

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _measures(trainer):
            self._start(trainer, "test")

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, *_: Any) -> None:
        if _measures(trainer):
            self._evaluation_batch(trainer, module, "test", batch)

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _measures(trainer):
            self._start(trainer, "predict")

    def on_predict_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, *_: Any) -> None:
        if _measures(trainer):
            self._evaluation_batch(trainer, module, "predict", batch)

    # ------------------------------------------------------------------ measuring
    def _start(self, trainer: Trainer, name: str) -> None:
        stage = self._stages[name]
        # During fit every run starts afresh; a stage run on its own goes on from its previous run, as in Lightning.
        if str(trainer.state.fn) == "fit" or stage.start is None:
            stage.throughput.reset()
            stage.batches = stage.samples = stage.lengths = 0
            stage.pending.clear()
            stage.pauses, stage.paused, stage.last = [], [0.0], None
        stage.in_run = 0
        stage.start = self._clock.mark()

    @torch.inference_mode()  # batch_size_fn and length_fn may compute on tensors of the batch
    def _update(self, module: TrainingModule, name: str, batch: Any) -> None:
        stage = self._stages[name]
        stage.last = self._clock.mark()
        stage.batches += 1
        stage.in_run += 1
        stage.samples += self.batch_size_fn(batch)
        if self.length_fn is not None:
            stage.lengths += self.length_fn(batch)
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(module, "flops_per_batch")
            if not self._module_has_flops:
                rank_zero_warn(
                    f"ThroughputMonitor: {type(module).__name__} has no flops_per_batch attribute, so no FLOPs or MFU"
                    " are logged; set it (phalanx.utilities.throughput.measure_flops counts a batch's FLOPs)."
                )
        flops = getattr(module, "flops_per_batch", None) if self._module_has_flops else None
        lengths = stage.lengths if self.length_fn is not None else None
        record = _Record(stage.last, len(stage.pauses), stage.batches, stage.samples, lengths, flops)
        stage.pending.append(record)  # a window's worth at most: older points would fall out of the window anyway

    def _compute(self, name: str) -> dict[str, float]:
        """Turn the points recorded since the last computation into seconds, and compute the rates."""
        stage = self._stages[name]
        clock = self._clock
        if stage.pending:
            clock.wait(stage.pending[-1].mark)
        for start, end in stage.pauses[len(stage.paused) - 1 :]:
            stage.paused.append(stage.paused[-1] + clock.seconds(start, end))
        while stage.pending:
            record = stage.pending.popleft()
            seconds = clock.seconds(stage.start, record.mark) - stage.paused[record.pauses]
            stage.throughput.update(
                time=seconds,
                batches=record.batches,
                samples=record.samples,
                lengths=record.lengths,
                flops=record.flops,
            )
        separator = stage.throughput.separator
        return {f"{name}{separator}{key}": value for key, value in stage.throughput.compute().items()}

    def _evaluation_batch(self, trainer: Trainer, module: TrainingModule, name: str, batch: Any) -> None:
        self._update(module, name, batch)
        # Lightning's step here is the batch's number in this run of the stage (each validation counts from 1).
        step = self._stages[name].in_run
        every = trainer.log_every_n_steps
        if every and (step % every == 0 or trainer.should_stop):
            _log(trainer, self._compute(name), step)


def _measures(trainer: Trainer) -> bool:
    # Rank 0 measures for all (as in Lightning: its rates times the world size are the world's), when it can log.
    return trainer.is_global_zero and bool(trainer.loggers)


def _log(trainer: Trainer, metrics: dict[str, float], step: int, epoch: int | None = None) -> None:
    if not metrics:
        return
    # As Lightning, the values are in trainer.logged_metrics too (as tensors, like the others there); training's go to
    # the loggers with the epoch.
    trainer.logged_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})
    values = metrics if epoch is None else {**metrics, "epoch": epoch}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


__all__ = ["ThroughputMonitor"]
