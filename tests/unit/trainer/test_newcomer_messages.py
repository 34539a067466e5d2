"""What a new user is told: an epoch shorter than the logging interval, what ckpt_path='auto' resumed from, where
ckpt_path='last' looked."""

from __future__ import annotations

import warnings

import pytest
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

from phalanx.callbacks import ModelCheckpoint
from phalanx.loggers import CSVLogger

SHORTER = "fewer than log_every_n_steps"


def _fit_warnings(trainer, batches: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), DataLoader(regression_data(8 * batches), batch_size=8))
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("batches", "options", "warned"),
    [
        (16, {}, True),  # the README quickstart: 16 batches, the default interval of 50
        (49, {}, True),
        (50, {}, False),
        (4, {"log_every_n_steps": 5}, True),
        (4, {"log_every_n_steps": 4}, False),
        (4, {"limit_train_batches": 2, "log_every_n_steps": 3}, True),  # the batches the epoch runs count
        (4, {"log_every_n_steps": 5, "logger": False}, False),  # nothing to write to
        (4, {"log_every_n_steps": 5, "fast_dev_run": 2}, False),
    ],
)
def test_an_epoch_shorter_than_the_logging_interval_is_warned_once(tmp_path, batches, options, warned):
    options = {"logger": CSVLogger(tmp_path), "max_epochs": 2, **options}
    messages = [m for m in _fit_warnings(quiet_trainer(**options), batches) if SHORTER in m]
    assert len(messages) == (1 if warned else 0)
    if warned:
        every = options.get("log_every_n_steps", 50)
        runs = min(batches, options.get("limit_train_batches", batches))
        assert messages[0].startswith(f"The training epoch has {runs} batches, fewer than log_every_n_steps={every}")
        assert "Trainer(log_every_n_steps=...)" in messages[0]


def _fit_with_checkpoints(tmp_path, **fit_options):
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)],
        max_epochs=fit_options.pop("max_epochs", 1),
    )
    trainer.fit(Regressor(), DataLoader(regression_data(16), batch_size=8), **fit_options)
    return trainer


def test_auto_resume_says_which_file_or_that_there_was_none(tmp_path, capsys):
    _fit_with_checkpoints(tmp_path, ckpt_path="auto")
    out = capsys.readouterr().out
    # Only where this run writes: its ModelCheckpoint's folder (also the preemption folder), not default_root_dir.
    assert f"ckpt_path='auto': no complete checkpoint in {tmp_path / 'ckpts'}; starting from scratch" in out
    trainer = _fit_with_checkpoints(tmp_path, ckpt_path="auto", max_epochs=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "ckpt_path='auto'" in line]
    assert lines == [
        f"ckpt_path='auto': resuming from {trainer.ckpt_path} (global step 2, epoch 0): the furthest recorded"
        " progress of the 2 complete checkpoint(s) found (the most recently written of 2 that record the same"
        f" progress) in {tmp_path / 'ckpts'}"
    ]
    assert trainer.ckpt_path.startswith(str(tmp_path / "ckpts"))


@pytest.mark.parametrize("dirpath", ["given", None])
def test_the_last_error_names_the_folder_it_searched_and_auto(tmp_path, dirpath):
    folder = tmp_path / "given" if dirpath else tmp_path / "checkpoints"
    callback = ModelCheckpoint(dirpath=folder if dirpath else None, save_last=True)
    trainer = quiet_trainer(default_root_dir=tmp_path, enable_checkpointing=True, callbacks=[callback])
    with pytest.raises(ValueError) as error:
        trainer.fit(Regressor(), DataLoader(regression_data(16), batch_size=8), ckpt_path="last")
    message = str(error.value)
    assert message.startswith(f"ckpt_path='last': no complete last checkpoint (last*.ckpt) in {folder}.")
    assert "ModelCheckpoint(save_last=True)" in message and "ckpt_path='auto'" in message
