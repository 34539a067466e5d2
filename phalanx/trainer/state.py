"""What the Trainer is doing: its function (fit, validate, ...), stage and status."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TrainerFn(str, Enum):
    """The user-facing entry point in progress."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    def __str__(self) -> str:
        return self.value


class RunningStage(str, Enum):
    """The loop currently running."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    def __str__(self) -> str:
        return self.value

    @property
    def evaluating(self) -> bool:
        """Whether this is validation or test (the sanity check is not)."""
        return self in (RunningStage.VALIDATING, RunningStage.TESTING)

    @property
    def dataloader_prefix(self) -> str:
        """The prefix of this stage's dataloader hook and limit: 'train', 'val', 'test' or 'predict'."""
        return "val" if self in (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING) else self.value


class TrainerStatus(str, Enum):
    """How the last run ended (or that one is running)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    @property
    def stopped(self) -> bool:
        """Whether the run is over: finished, interrupted or failed."""
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED, TrainerStatus.FAILED)


@dataclass
class TrainerState:
    """The Trainer's function, stage and status."""

    fn: TrainerFn | None = None
    stage: RunningStage | None = None
    status: TrainerStatus = TrainerStatus.INITIALIZING

    @property
    def finished(self) -> bool:
        """Whether the last run ended normally."""
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        """Whether the last run is over, however it ended (see :attr:`TrainerStatus.stopped`)."""
        return self.status.stopped
