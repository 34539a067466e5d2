"""OnExceptionCheckpoint: a failing fit leaves the checkpoint Lightning's leaves (same step, same weights), loadable
with ``weights_only=True`` and resumable; a successful stage removes it, except the one it resumed from; a failed save
never hides the original error; several processes are refused at set-up."""

from __future__ import annotations

import callback_project as project
import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from phalanx.utilities.exceptions import MisconfigurationError


def test_a_failing_fit_saves_what_lightnings_saves(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    theirs = project.run("lightning", "exception", tmp_path / "lightning")
    ours = project.run("phalanx", "exception", tmp_path / "phalanx")
    assert ours["error"] == theirs["error"] == "failing at step 5 on purpose"
    assert ours["files"] == theirs["files"] == ["ckpt/on_exception.ckpt"]
    mine = torch.load(tmp_path / "phalanx" / "ckpt" / "on_exception.ckpt", weights_only=True)
    their = torch.load(tmp_path / "lightning" / "ckpt" / "on_exception.ckpt", weights_only=False)
    assert mine["global_step"] == their["global_step"] == 5
    assert mine["state_dict"].keys() == their["state_dict"].keys()
    for name, value in their["state_dict"].items():
        assert torch.equal(mine["state_dict"][name], value), name


def test_the_checkpoint_resumes_and_a_successful_fit_keeps_it(tmp_path):
    project.run("phalanx", "exception", tmp_path / "failed")
    saved = tmp_path / "failed" / "ckpt" / "on_exception.ckpt"
    whole = project.run("phalanx", "lambda", tmp_path / "whole")  # the same project, without the failure
    callback = OnExceptionCheckpoint(tmp_path / "failed" / "ckpt")
    model = project.module_class("phalanx")()
    trainer = quiet_trainer(max_epochs=project.EPOCHS, callbacks=[callback], enable_checkpointing=True)
    train = torch.utils.data.DataLoader(project.data(), batch_size=project.BATCH)
    trainer.fit(model, train, ckpt_path=saved)
    assert trainer.global_step == whole["global_step"]
    assert model.losses == pytest.approx(whole["losses"][5:], rel=1e-6)
    assert saved.exists()  # the checkpoint this fit resumed from is never removed


def test_with_the_defaults_a_successful_stage_removes_a_stale_checkpoint(tmp_path):
    stale = tmp_path / "on_exception.ckpt"
    stale.write_bytes(b"from an earlier run")
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[OnExceptionCheckpoint(tmp_path)]
    )
    trainer.fit(Regressor(), *loaders())
    assert not stale.exists()
    # As in Lightning, any Checkpoint callback counts: no default ModelCheckpoint is added next to it.
    assert not [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]


def test_a_failed_save_warns_and_the_original_error_is_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")

    class Failing(Regressor):
        def training_step(self, batch, batch_idx):
            raise KeyError("the original error")

    trainer = quiet_trainer(
        max_epochs=1, callbacks=[OnExceptionCheckpoint(blocker / "below")], enable_checkpointing=True
    )
    with pytest.warns(UserWarning, match="OnExceptionCheckpoint could not save .* after KeyError"):
        with pytest.raises(KeyError, match="the original error"):
            trainer.fit(Failing(), *loaders())


def test_enable_checkpointing_false_is_refused_next_to_it(tmp_path):
    with pytest.raises(ValueError, match="enable_checkpointing=False, but OnExceptionCheckpoint was passed"):
        quiet_trainer(callbacks=[OnExceptionCheckpoint(tmp_path)])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dirpath": "x", "filename": ""}, "filename=''"), ({"dirpath": ""}, "dirpath=''")],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnExceptionCheckpoint(**kwargs)


def test_several_processes_are_refused_at_set_up(tmp_path, monkeypatch):
    trainer = quiet_trainer(max_epochs=1, callbacks=[OnExceptionCheckpoint(tmp_path)], enable_checkpointing=True)
    monkeypatch.setattr(type(trainer.strategy), "world_size", property(lambda self: 2))
    with pytest.raises(MisconfigurationError, match="OnExceptionCheckpoint cannot run on 2 processes"):
        trainer.fit(Regressor(), *loaders())
    assert not (tmp_path / "on_exception.ckpt").exists()
