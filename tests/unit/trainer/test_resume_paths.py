"""Which checkpoint a run resumes from ('last' after a killed save), and that this checkpoint survives the run."""

from __future__ import annotations

from pathlib import Path

import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint


def _first_run(root: Path, **checkpoint_options) -> ModelCheckpoint:
    callback = ModelCheckpoint(dirpath=root / "checkpoints", **checkpoint_options)
    trainer = quiet_trainer(default_root_dir=root, max_steps=8, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(Regressor(), loaders()[0])
    return callback


def test_last_skips_an_empty_reservation_and_a_truncated_file_left_by_killed_saves(tmp_path):
    _first_run(tmp_path, save_last=True, save_top_k=0)
    directory = tmp_path / "checkpoints"
    good = directory / "last.ckpt"
    assert good.exists()
    (directory / "last-v1.ckpt").write_bytes(b"")  # a name claimed by a save that was killed before writing
    (directory / "last-v2.ckpt").write_bytes(good.read_bytes()[:100])  # a file cut short by a full disk
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_steps=10,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)],
        enable_checkpointing=True,
    )
    trainer.fit(Regressor(), loaders()[0], ckpt_path="last")
    assert trainer.ckpt_path == str(good)
    assert trainer.global_step == 10


def test_the_checkpoint_a_run_resumed_from_is_never_removed_by_top_k(tmp_path):
    callback = _first_run(tmp_path, save_top_k=1, monitor="train_loss", mode="max", every_n_train_steps=2)
    resumed_from = Path(callback.best_model_path)
    before = resumed_from.read_bytes()
    # The resumed run's callback ranks by mode="min": its later saves beat the file it resumed from, which top-1
    # would therefore remove if it did not know where the run started.
    newer = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", save_top_k=1, monitor="train_loss", mode="min", every_n_train_steps=2
    )
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=16, callbacks=[newer], enable_checkpointing=True)
    trainer.fit(Regressor(), loaders()[0], ckpt_path=str(resumed_from))
    assert trainer.ckpt_path == str(resumed_from)
    assert resumed_from.exists() and resumed_from.read_bytes() == before
    assert Path(newer.best_model_path) != resumed_from and Path(newer.best_model_path).exists()
    assert torch.load(newer.best_model_path, weights_only=True)["global_step"] > 8
