"""Timer: measure the time each stage takes, and stop training once a duration has passed (Lightning's ``Timer``)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.callback import Callback
from phalanx.utilities.durations import parse_duration
from phalanx.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

#: The stages a Timer measures, by the values of ``phalanx.trainer.state.RunningStage`` (and Lightning's).
STAGES = ("train", "sanity_check", "validate", "test", "predict")
INTERVALS = ("step", "epoch")


def _stage(stage: Any) -> str:
    name = getattr(stage, "value", stage)
    if name not in STAGES:
        raise ValueError(f"stage={stage!r} is not a stage a Timer measures; choose one of {list(STAGES)}.")
    return name


class Timer(Callback):
    """Track the time spent in training, validation and testing, and stop training once ``duration`` has passed.

    ``Trainer(max_time=...)`` adds ``Timer(duration=max_time, interval="step")`` unless a Timer is among the callbacks
    (then ``max_time`` is ignored, as in Lightning).

    The training time is saved in checkpoints and a resumed run counts on from it: the duration covers the whole
    training, not each fit. Global rank 0's clock decides and every rank gets its decision, so all processes stop
    after the same batch (with several processes that costs one broadcast per check). Stopping sets
    ``trainer.should_stop``, which waits for ``min_epochs`` and ``min_steps``.

    Args:
        duration: How long training may run: a ``'DD:HH:MM:SS'`` string, a ``datetime.timedelta`` or a dict of its
            keywords (``{"hours": 12}``); None only measures.
        interval: When to check: ``"step"`` after every training batch, ``"epoch"`` at the end of every training
            epoch. The check also runs when fit starts, so a run resumed with its time already spent trains no more.
        verbose: Say (on rank 0, at INFO level) when the time limit stops training.
    """

    def __init__(
        self,
        duration: str | timedelta | dict[str, int] | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        interval = getattr(interval, "value", interval)
        if interval not in INTERVALS:
            raise ValueError(f"Timer(interval={interval!r}) is not valid; choose 'step' or 'epoch'.")
        try:
            self._duration = parse_duration(duration, "duration")
        except (TypeError, ValueError) as error:
            raise type(error)(f"Timer: {error}") from None
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0

    @property
    def duration(self) -> float | None:
        """The time limit in seconds (None: no limit)."""
        return self._duration

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (a ``time.monotonic()`` value), or None."""
        return self._start_time[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended (a ``time.monotonic()`` value), or None."""
        return self._end_time[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (its last run; for training, plus the time of the run a checkpoint resumed)."""
        stage = _stage(stage)
        start, end = self._start_time[stage], self._end_time[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        if end is None:
            return time.monotonic() - start + offset
        return end - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (None without one); negative once it has passed."""
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    def _start(self, stage: str) -> None:
        self._start_time[stage] = time.monotonic()
        self._end_time[stage] = None

    def _end(self, stage: str) -> None:
        self._end_time[stage] = time.monotonic()

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start("train")

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end("train")

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start("validate")

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end("validate")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start("test")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end("test")

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # After a checkpoint is restored: a resumed run whose time is already spent stops before training.
        if self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._interval == "step" and self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._interval == "epoch" and self._duration is not None:
            self._check_time_remaining(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The seconds spent in each stage; a resumed run counts training on from its value."""
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        elapsed = state_dict.get("time_elapsed", {}).get("train", 0.0)
        if not isinstance(elapsed, (int, float)) or isinstance(elapsed, bool) or elapsed < 0:
            raise ValueError(f"the Timer's saved training time must be a number >= 0, got {elapsed!r}.")
        self._offset = float(elapsed)

    def _check_time_remaining(self, trainer: Trainer) -> None:
        assert self._duration is not None
        # Rank 0 decides: the processes' clocks differ, and a process stopping alone would leave the others waiting.
        should_stop = bool(trainer.strategy.broadcast(self.time_elapsed() >= self._duration))
        trainer.should_stop = trainer.should_stop or should_stop
        if should_stop and self._verbose:
            elapsed = timedelta(seconds=int(self.time_elapsed("train")))
            rank_zero_info(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")


__all__ = ["Timer"]
