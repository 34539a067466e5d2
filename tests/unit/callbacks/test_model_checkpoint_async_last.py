"""``save_last`` under AsyncCheckpointIO: ``last.ckpt`` (a copy or a link) only ever names a complete checkpoint,
whether the background write of the save point succeeds, fails or is still in flight (a killed write: see
tests/distributed/test_checkpoint_io_crash.py)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import Callback, ModelCheckpoint
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

STEP4 = "epoch=0-step=4.ckpt"


class _ScriptedIO(TorchCheckpointIO):
    """Writes normally, except step 4's top-k checkpoint: that write fails (disk full) or waits for a release."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.started, self.released = threading.Event(), threading.Event()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if str(path).endswith(STEP4):
            if self.outcome == "fails":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            if self.outcome == "in flight":
                self.started.set()
                assert self.released.wait(timeout=120), "the test never released the write"
        super().save_checkpoint(checkpoint, path, storage_options)


class _LookWhileInFlight(Callback):
    """At step 5 (step 4's write still held back), note what last.ckpt holds, then let the write go on."""

    def __init__(self, io: _ScriptedIO, dirpath: Path) -> None:
        self.io, self.dirpath, self.seen = io, dirpath, None

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 5 and self.io.outcome == "in flight":
            try:
                assert self.io.started.wait(timeout=120), "step 4's write never started"
                self.seen = (_step(self.dirpath / "last.ckpt"), _visible(self.dirpath))
            finally:
                self.io.released.set()


class _ResumedAt(Callback):
    step = -1

    def on_train_start(self, trainer: Any, module: Any) -> None:
        _ResumedAt.step = trainer.global_step


def _step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def _visible(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir() if not p.name.startswith("."))


def _fit(
    dirpath: Path, save_last: Any, io: Any = None, extra: list | None = None, ckpt_path: Any = None, max_steps: int = 6
) -> Any:
    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=save_last)
    trainer = quiet_trainer(
        max_steps=max_steps,
        callbacks=[callback, *(extra or [])],
        enable_checkpointing=True,
        plugins=[io] if io is not None else None,
    )
    trainer.fit(Regressor(), loaders()[0], ckpt_path=ckpt_path)
    return trainer


ALL = ["epoch=0-step=2.ckpt", STEP4, "epoch=0-step=6.ckpt", "last.ckpt"]
# outcome of step 4's background write -> (last.ckpt's step while it is in flight, the files after the run, the step
# last.ckpt holds after the run = the newest complete checkpoint, which fit(ckpt_path="last") resumes from)
OUTCOMES = [
    ("succeeds", None, ALL, 6),
    ("fails", None, ["epoch=0-step=2.ckpt", "last.ckpt"], 2),
    ("in flight", (2, ["epoch=0-step=2.ckpt", "last.ckpt"]), ALL, 6),
]


@pytest.mark.parametrize("save_last", [True, "link"])
@pytest.mark.parametrize(("outcome", "in_flight", "files", "last_step"), OUTCOMES, ids=[o[0] for o in OUTCOMES])
def test_last_only_ever_names_a_complete_checkpoint(tmp_path, save_last, outcome, in_flight, files, last_step):
    inner = _ScriptedIO(outcome)
    look = _LookWhileInFlight(inner, tmp_path)
    if outcome == "fails":  # raised at the next save, copy or link that finds it failed (step 4's or 6's)
        with pytest.raises(Exception, match=rf"background checkpoint save failed.*No space left.*{STEP4}"):
            _fit(tmp_path, save_last, AsyncCheckpointIO(inner), [look])
    else:
        _fit(tmp_path, save_last, AsyncCheckpointIO(inner), [look])
    assert look.seen == in_flight
    assert _visible(tmp_path) == files
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no claim or temporary left
    assert _step(tmp_path / "last.ckpt") == last_step
    assert os.path.islink(tmp_path / "last.ckpt") == (save_last == "link")
    _fit(tmp_path, save_last, extra=[_ResumedAt()], ckpt_path="last", max_steps=8)  # a resume with steps to take
    assert _ResumedAt.step == last_step


def test_last_recorded_in_process_but_never_written_falls_back_to_the_newest_complete_last(tmp_path):
    # A background write that failed leaves the callback's last_model_path naming a file that was never made; the
    # same process's fit(ckpt_path="last") must then resume from the newest complete last*.ckpt on disk.
    trainer = _fit(tmp_path, True)
    callback = trainer.checkpoint_callback
    callback.last_model_path = str(tmp_path / "last-v1.ckpt")
    trainer.max_steps = 8
    resumed = _ResumedAt()
    trainer.callbacks.append(resumed)
    trainer.fit(Regressor(), loaders()[0], ckpt_path="last")
    assert _ResumedAt.step == 6
