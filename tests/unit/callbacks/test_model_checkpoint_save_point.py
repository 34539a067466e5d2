"""Where ModelCheckpoint saves by default (Lightning's rule): at the end of the training epoch unless validation runs
several times per epoch or not every epoch, so a fit that ``max_steps`` ends inside an epoch keeps its final step."""

from __future__ import annotations

import os

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint


def _files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".ckpt"))


# 4 training batches per epoch; max_steps=6 stops inside epoch 1, after its batch 1.
CASES = [
    # (validation, monitor, save_top_k, Trainer options, files)
    (False, None, 1, {}, ["epoch=1-step=6.ckpt"]),
    (True, None, 1, {}, ["epoch=1-step=6.ckpt"]),
    (True, "train_loss", 2, {}, ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"]),
    # the monitored value is the latest one (epoch 0's validation), as in Lightning
    (True, "val_loss", -1, {}, ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"]),
    (True, None, -1, {"max_epochs": 2, "max_steps": -1}, ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]),
    # validation twice an epoch: saves follow validation, and step 5 has none
    (True, None, -1, {"max_steps": 5, "val_check_interval": 0.5}, ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]),
    # validation every second epoch: saves follow validation (epoch 1's, never reached)
    (True, None, -1, {"check_val_every_n_epoch": 2}, []),
]


@pytest.mark.parametrize(("validation", "monitor", "top_k", "options", "files"), CASES)
def test_a_fit_ended_by_max_steps_saves_its_final_step(tmp_path, validation, monitor, top_k, options, files):
    train, val = loaders(n=32, batch_size=8)
    callback = ModelCheckpoint(dirpath=tmp_path, monitor=monitor, save_top_k=top_k)
    settings = {"max_epochs": 5, "max_steps": 6, "num_sanity_val_steps": 0, **options}
    trainer = quiet_trainer(callbacks=[callback], enable_checkpointing=True, **settings)
    trainer.fit(Regressor(), train, val if validation else None)
    assert _files(tmp_path) == files
    if files:
        assert callback.last_model_path == "" and os.path.basename(callback.best_model_path) in files


def test_final_step_checkpoint_resumes_at_the_next_batch(tmp_path):
    train, val = loaders(n=32, batch_size=8, shuffle=False)
    trainer = quiet_trainer(
        max_epochs=2, max_steps=6, num_sanity_val_steps=0, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path)],
    )  # fmt: skip
    trainer.fit(Regressor(), train, val)
    seen: list[tuple[int, int]] = []

    class Recording(Regressor):
        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, batch_idx))
            return super().training_step(batch, batch_idx)

    resumed = quiet_trainer(max_epochs=2, num_sanity_val_steps=0)
    resumed.fit(Recording(), train, val, ckpt_path=str(tmp_path / "epoch=1-step=6.ckpt"))
    assert seen == [(1, 2), (1, 3)] and resumed.global_step == 8
