"""The Trainer's loggers and callbacks: built from its ``logger=`` and ``callbacks=`` arguments, and merged with the
callbacks a module adds in ``configure_callbacks``."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from phalanx.callbacks import (
    Checkpoint,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    RichModelSummary,
    RichProgressBar,
    Timer,
    TQDMProgressBar,
)
from phalanx.callbacks.callback import Callback
from phalanx.loggers import CSVLogger, Logger
from phalanx.loggers.logger import logger_list, share_logger_states
from phalanx.utilities.messages import reject_class, shown
from phalanx.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def build_loggers(logger: Any, *, default_root_dir: str) -> list[Logger]:
    """The loggers ``logger=`` asks for: a CSVLogger under ``default_root_dir`` for True or None, none for False."""
    if logger is True or logger is None:
        return [CSVLogger(save_dir=default_root_dir, name="logs")]
    if logger is False:
        return []
    return logger_list(
        logger,
        argument="logger",
        choices="True, False, a Logger instance (e.g. CSVLogger(save_dir=...)) or a list of them",
    )


def agree_on_log_versions(trainer: Trainer) -> None:
    """Give every rank the run global rank 0's loggers write to (rank 0 claims its ``version_N`` folders, or creates
    its tracker runs, here): ``Logger.shared_state`` on rank 0, ``adopt_shared_state`` on the others.

    Each rank would otherwise compute its own, and a run started in the same folder between rank 0's claim and
    another rank's count makes that rank name ``version_N+1``, a folder that run owns (Lightning broadcasts it too).
    One broadcast per stage on every rank, whatever loggers each has, so that no rank waits for another.
    """
    share_logger_states(trainer.loggers, trainer.strategy)


def build_callbacks(
    callbacks: Any,
    *,
    enable_progress_bar: bool,
    enable_checkpointing: bool,
    enable_model_summary: bool,
    max_time: float | None = None,
) -> list[Callback]:
    """The user's callbacks, checked, plus the default checkpoint, progress bar and summary callbacks left enabled,
    and the Timer that carries out ``max_time`` (seconds) unless the user's callbacks hold one, as in Lightning."""
    items = callback_list(callbacks)
    if max_time is not None:
        if any(isinstance(cb, Timer) for cb in items):
            rank_zero_info("Ignoring Trainer(max_time=...): the callbacks already hold a Timer, whose duration counts.")
        else:
            items.append(Timer(duration=timedelta(seconds=max_time), interval="step"))
    # Any Checkpoint counts (OnExceptionCheckpoint too), as in Lightning.
    if enable_checkpointing and not any(isinstance(cb, Checkpoint) for cb in items):
        items.append(ModelCheckpoint())
    elif not enable_checkpointing and any(isinstance(cb, Checkpoint) for cb in items):
        names = sorted({type(cb).__name__ for cb in items if isinstance(cb, Checkpoint)})
        raise ValueError(f"enable_checkpointing=False, but {', '.join(names)} was passed; remove one of them.")
    if enable_progress_bar and not any(isinstance(cb, ProgressBar) for cb in items):
        items.append(TQDMProgressBar())
    elif not enable_progress_bar and any(isinstance(cb, ProgressBar) for cb in items):
        raise ValueError("enable_progress_bar=False, but a progress bar callback was passed; remove one of them.")
    if enable_model_summary and not any(isinstance(cb, ModelSummary) for cb in items):
        # As in Lightning: with a RichProgressBar, the summary is drawn with rich too.
        rich = any(isinstance(cb, RichProgressBar) for cb in items)
        items.append(RichModelSummary() if rich else ModelSummary())
    return checkpoints_last(items)


def callback_list(callbacks: Any) -> list[Callback]:
    """``callbacks=`` (None, one Callback, or a list or tuple of them) as a list; anything else is refused by name."""
    reject_class("callbacks", callbacks, Callback, "")
    if callbacks is None:
        items: list[Callback] = []
    elif isinstance(callbacks, Callback):
        items = [callbacks]
    elif isinstance(callbacks, (list, tuple)):
        items = list(callbacks)
    else:
        raise TypeError(
            f"callbacks={shown(callbacks)} (of type {type(callbacks).__name__}) is not valid; pass a Callback"
            " instance or a list of them."
        )
    for index, callback in enumerate(items):
        reject_class(f"callbacks[{index}]", callback, Callback, "")
        if not isinstance(callback, Callback):
            raise TypeError(
                f"callbacks[{index}]={shown(callback)} (of type {type(callback).__name__}) is not a phalanx"
                " Callback; pass Callback instances."
            )
    return items


def merge_module_callbacks(callbacks: list[Callback], module: TrainingModule) -> list[Callback]:
    """``callbacks`` with those of ``module.configure_callbacks()``, which replace the callbacks of the same types."""
    extra = module.configure_callbacks()
    if extra is None:
        return callbacks
    extra = [extra] if isinstance(extra, Callback) else list(extra)
    if not extra:
        return callbacks
    replaced_types = {type(cb) for cb in extra}
    kept = [cb for cb in callbacks if type(cb) not in replaced_types and cb not in extra]
    return checkpoints_last(kept + extra)


def checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the Checkpoint callbacks (ModelCheckpoint, OnExceptionCheckpoint) moved to the end, in their
    order."""
    # Checkpointing runs after every other callback so that it saves the state they produced.
    return [cb for cb in callbacks if not isinstance(cb, Checkpoint)] + [
        cb for cb in callbacks if isinstance(cb, Checkpoint)
    ]


__all__ = [
    "agree_on_log_versions",
    "build_callbacks",
    "build_loggers",
    "callback_list",
    "checkpoints_last",
    "merge_module_callbacks",
]
