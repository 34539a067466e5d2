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


class TrainerStatus(str, Enum):
    """How the last run ended (or that one is running)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass
class TrainerState:
    """The Trainer's function, stage and status."""

    fn: TrainerFn | None = None
    stage: RunningStage | None = None
    status: TrainerStatus = TrainerStatus.INITIALIZING
