"""OnExceptionCheckpoint: save a checkpoint when a run raises (Lightning's ``OnExceptionCheckpoint``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from phalanx.callbacks._checkpoint_files import resumed_locations
from phalanx.callbacks.model_checkpoint import Checkpoint
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


class OnExceptionCheckpoint(Checkpoint):
    """Save ``dirpath/filename.ckpt`` (``trainer.save_checkpoint``) when fit, validate, test or predict raises,
    KeyboardInterrupt included; ``trainer.fit(model, ckpt_path=callback.ckpt_path)`` resumes from it.

    As in Lightning, a stage that ends without an exception removes that file (a stale one would look like the state
    of this run), except the checkpoint the stage resumed from. A save that fails itself only warns: the original
    exception is what the run raises.

    Single-process runs only: with several processes a save needs all of them, and an exception may have stopped
    only some, so the save would wait forever. Several processes are refused at set-up; there
    ``ModelCheckpoint(every_n_train_steps=...)`` saves regularly, and ``Trainer(preemption=True)`` (the default) saves
    on SIGTERM and SIGUSR1 at a point every process reaches.

    Args:
        dirpath: The folder of the checkpoint.
        filename: Its name, without the ``.ckpt`` extension.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        super().__init__()
        if not isinstance(filename, str) or not filename:
            raise ValueError(f"OnExceptionCheckpoint(filename={filename!r}) is not valid; pass a non-empty name.")
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ValueError(f"OnExceptionCheckpoint(dirpath={dirpath!r}) is not valid; pass the folder to save in.")
        # Given now, not at set-up: an exception can come before any set-up has run.
        self.dirpath = dirpath
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        """Where the checkpoint is written."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise MisconfigurationError(
                f"OnExceptionCheckpoint cannot run on {trainer.world_size} processes: a save needs every process,"
                " and an exception may stop only some of them, so the save would wait forever. Remove it, and use"
                " ModelCheckpoint(every_n_train_steps=...) to save regularly and Trainer(preemption=True) (the"
                " default) to save on SIGTERM or SIGUSR1."
            )

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        if trainer.world_size > 1 or trainer.strategy.module is None:
            return  # refused at set-up, or raised before a module was connected: nothing to save
        try:
            trainer.save_checkpoint(self.ckpt_path)
        except Exception as error:  # the original exception is the one to report: never replace it with this one
            rank_zero_warn(
                f"OnExceptionCheckpoint could not save {self.ckpt_path} after {type(exception).__name__}:"
                f" {type(error).__name__}: {error}"
            )
            return
        rank_zero_info(f"OnExceptionCheckpoint: {type(exception).__name__}; saved {self.ckpt_path}")

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        resumed = resumed_locations(getattr(trainer, "ckpt_path", None))
        if resumed and set(resumed) & set(resumed_locations(self.ckpt_path)):
            return  # never remove the checkpoint the run went on from
        trainer.strategy.remove_checkpoint(self.ckpt_path)


__all__ = ["OnExceptionCheckpoint"]
