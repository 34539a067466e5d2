"""``trainer.save_checkpoint`` after a stage, under AsyncCheckpointIO: the write is finished when the call returns,
and a write that fails raises there (no stage's teardown is left to report it)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointWriteError


class _FullDisk(TorchCheckpointIO):
    """Full when ``full``: then a write of after.ckpt fails."""

    full = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if self.full and Path(path).name == "after.ckpt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def _foreign_folder(path: Path) -> None:
    path.mkdir()
    (path / "payload").write_text("the user's")


def _run(trainer: Any, stage: str) -> None:
    train, val = loaders()
    if stage == "fit":
        trainer.fit(Regressor(), train)
    elif stage == "validate":
        trainer.validate(Regressor(), val)
    else:
        trainer.fit(Regressor(), train)
        trainer.test(trainer.module, val)


# what the save after the stage meets -> the message it must raise with (None: it succeeds, whole on return)
FAILURES = [
    ("nothing", None),
    ("a full disk", r"background checkpoint save failed: \[Errno 28\] No space left on device: '.*after\.ckpt'"),
    ("a folder of the user's", r"Refusing to write a checkpoint at .*after\.ckpt: a directory without"),
]


@pytest.mark.parametrize("stage", ["fit", "validate", "fit then test"])
@pytest.mark.parametrize(("meets", "message"), FAILURES, ids=[f[0] for f in FAILURES])
def test_a_save_after_a_stage_is_finished_or_raises(tmp_path, stage, meets, message):
    disk = _FullDisk()
    trainer = quiet_trainer(max_steps=2, plugins=[AsyncCheckpointIO(disk)])
    _run(trainer, stage)
    disk.full = meets == "a full disk"
    path = tmp_path / "after.ckpt"
    if meets == "a folder of the user's":
        _foreign_folder(path)
    if message is None:
        trainer.save_checkpoint(path)
        assert torch.load(path, weights_only=True)["global_step"] == trainer.global_step  # whole on return
        return
    # A full disk is met by the background write; a folder of the user's is refused before anything is queued.
    with pytest.raises((RuntimeError, CheckpointWriteError), match=message):
        trainer.save_checkpoint(path)
    assert not path.is_file()
    if meets == "a folder of the user's":
        assert (path / "payload").read_text() == "the user's"
    trainer.save_checkpoint(tmp_path / "later.ckpt")  # the failure was reported once; a later save works
    assert torch.load(tmp_path / "later.ckpt", weights_only=True)["global_step"] == trainer.global_step
