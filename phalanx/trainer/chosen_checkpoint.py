"""``trainer.ckpt_path = path``: Lightning's way of choosing the checkpoint that the next stages load."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from phalanx.trainer.state import RunField
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class ChosenCheckpoint(RunField[str | None]):
    """``trainer.ckpt_path``: the checkpoint the current (or last) stage started from; assigning one chooses the
    checkpoint that the next stages load when they are given none, as Lightning's setter does, until ``None`` is
    assigned or a stage is given its own ``ckpt_path`` (which wins, with a warning, and ends the choice)."""

    def __init__(self) -> None:
        super().__init__(writable=True)

    def __set__(self, trainer: object, value: str | os.PathLike | None) -> None:
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(
                f"trainer.ckpt_path = {value!r} (of type {type(value).__name__}) is not valid; assign a path, 'last',"
                f" 'best', 'auto', or None to stop choosing."
            )
        path = None if value is None else os.fspath(value)
        if path == "":
            raise ValueError(
                "trainer.ckpt_path = '' is not a path; assign a checkpoint path, or None to stop choosing."
            )
        run = trainer._run  # type: ignore[attr-defined]
        run.ckpt_path = run.chosen_ckpt_path = path


def chosen_ckpt_path(trainer: Trainer, ckpt_path: Any, method: str) -> Any:
    """The checkpoint a stage loads: its own ``ckpt_path``, else the one ``trainer.ckpt_path = ...`` chose (as in
    Lightning, a stage given its own wins with a warning and ends the choice)."""
    chosen = trainer._run.chosen_ckpt_path
    if chosen is None:
        return ckpt_path
    if ckpt_path is None:
        return chosen
    rank_zero_warn(
        f"trainer.ckpt_path = {chosen!r} was assigned, but {method}(ckpt_path={ckpt_path!r}) was passed: the latter is"
        f" loaded, and later stages no longer load {chosen!r} unless it is assigned again."
    )
    trainer._run.chosen_ckpt_path = None
    return ckpt_path


__all__ = ["ChosenCheckpoint", "chosen_ckpt_path"]
