"""What the Trainer is doing: its function (fit, validate, ...), stage and status, and what its runs fill in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

if TYPE_CHECKING:
    from phalanx.datamodule import DataModule
    from phalanx.trainer.logging.results import LoggedResults
    from phalanx.trainer.loops.data import DataSource
    from phalanx.trainer.loops.optimizer import ManualOptimizer


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


@dataclass
class RunState:
    """Everything the Trainer's stages fill in, as opposed to its settings: the one place per-run state is declared.

    The Trainer owns one (``trainer._run``), made with the Trainer; the stages set and reset the fields they own at
    the points named below, so a later stage on the same Trainer sees what the earlier one left, as in Lightning.
    The Lightning-public fields (``num_*_batches``, ``should_stop``, ``ckpt_path``, ...) are read through the
    Trainer's properties of the same names.

    Groups of fields:

    - **Data** (``datamodule``, ``data_source``, ``train_dataloader``, ``val_dataloaders``, ``val_limits`` and the
      epochs they were built in): set by the stage's set-up and by fit's data preparation; ``fit`` drops the
      training dataloader so that each fit builds it anew.
    - **Batch counts** (``num_training_batches``, ``num_val_batches``, ``num_sanity_val_batches``,
      ``num_test_batches``, ``num_predict_batches``): each set by the stage that runs those batches and kept until
      that stage runs again.
    - **Validation schedule inside fit** (``validation_enabled``, ``val_every_batches``, ``val_across_epochs``): set
      with fit's validation data.
    - **Stopping** (``should_stop``, ``stop_now``, ``preempted``): the two stop requests are cleared when a stage
      starts, ``preempted`` when a fit starts (``max_time`` is a Timer callback's, which sets ``should_stop``).
    - **Optimization** (``manual_optimizers``, ``optimizer``, ``loss_divisor`` and the schedulers by interval): set
      when fit prepares the optimizers.
    - **Checkpoint and logging** (``ckpt_path``, ``chosen_ckpt_path``, ``results``, ``loggers_finalized``): the
      checkpoint the stage started from, and the one ``trainer.ckpt_path = ...`` chose for the next stages; the
      results ``self.log`` records into now (None outside a stage); whether this stage's teardown finalised the
      loggers (cleared when a stage starts).
    - **Profiling** (``profiled``): the wrappers a recording profiler installed for the stage
      (:mod:`phalanx.trainer.profiling`), removed when it ends.
    - **Prediction writers** (``predict_batch_indices``, ``predict_epoch_batch_indices``, ``predict_outputs``): what
      ``BasePredictionWriter`` callbacks read, set by the predict loop (see
      :mod:`phalanx.trainer.loops.prediction_writing`).
    """

    # Data
    datamodule: DataModule | None = None
    data_source: DataSource | None = None
    train_dataloader: Any = None  # built anew for each fit (estimated_stepping_batches may build it early)
    train_data_epoch: int = 0  # the epochs the fit's dataloaders were last built in
    val_data_epoch: int = 0
    val_dataloaders: list[Any] = field(default_factory=list)
    val_limits: list[int | float] = field(default_factory=list)
    # Batch counts
    num_training_batches: int | float = 0
    num_val_batches: list[int | float] = field(default_factory=list)
    num_sanity_val_batches: list[int | float] = field(default_factory=list)
    num_test_batches: list[int | float] = field(default_factory=list)
    num_predict_batches: list[int | float] = field(default_factory=list)
    # Validation schedule inside fit
    validation_enabled: bool = False
    val_every_batches: int | None = None
    val_across_epochs: bool = False
    # Stopping
    should_stop: bool = False
    stop_now: bool = False  # stop after this batch, min_epochs/min_steps notwithstanding
    preempted: bool = False
    # Optimization
    manual_optimizers: list[ManualOptimizer] = field(default_factory=list)
    optimizer: Any = None  # the one optimizer of automatic optimization, None with manual optimization
    loss_divisor: int = 1
    step_scheduler_configs: list[Any] = field(default_factory=list)
    epoch_scheduler_configs: list[Any] = field(default_factory=list)
    # Checkpoint and logging
    ckpt_path: str | None = None  # resolved: 'last', 'best', 'auto' become a path
    chosen_ckpt_path: str | None = None  # assigned as trainer.ckpt_path: loaded by the stages not given one
    results: LoggedResults | None = None
    loggers_finalized: bool = False
    # Profiling: the (object, attribute, wrapper) a recording profiler installed for the stage, removed at its end
    profiled: list[tuple[Any, str, Any]] = field(default_factory=list)
    # Prediction writers: the current batch's dataset indices, every batch's and this process's outputs per dataloader
    predict_batch_indices: list[int] = field(default_factory=list)
    predict_epoch_batch_indices: list[list[list[int]]] = field(default_factory=list)
    predict_outputs: list[list[Any]] = field(default_factory=list)


_T = TypeVar("_T")


class RunField(Generic[_T]):
    """A Trainer attribute kept in the Trainer's :class:`RunState` under the same name.

    Read-only unless ``writable``: the stages set it; only what Lightning users assign (``trainer.should_stop``,
    ``trainer.ckpt_path``, ...) may be written through the Trainer.
    """

    def __init__(self, *, writable: bool = False) -> None:
        self.writable = writable
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, trainer: None, owner: type | None = None) -> RunField[_T]: ...

    @overload
    def __get__(self, trainer: object, owner: type | None = None) -> _T: ...

    def __get__(self, trainer: object, owner: type | None = None) -> _T | RunField[_T]:
        if trainer is None:
            return self
        return getattr(trainer._run, self.name)  # type: ignore[attr-defined]

    def __set__(self, trainer: object, value: _T) -> None:
        if not self.writable:
            raise AttributeError(f"trainer.{self.name} is set by the Trainer's stages and cannot be assigned.")
        setattr(trainer._run, self.name, value)  # type: ignore[attr-defined]

    def __delete__(self, trainer: object) -> None:
        # Without this, Python's message would be a bare "__delete__".
        instead = "assign it instead" if self.writable else "it is set by the Trainer's stages"
        raise AttributeError(f"trainer.{self.name} cannot be deleted: the Trainer reads it; {instead}.")
