"""An interrupted and resumed run ends with exactly the weights of an uninterrupted one (CPU, bit for bit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, same_parameters

import phalanx


class AdamWithScheduler(Regressor):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8),
        }


class Interrupt(phalanx.Callback):
    """Saves a checkpoint after ``at_step`` optimizer steps and then kills the run."""

    def __init__(self, at_step: int, path: str) -> None:
        self.at_step = at_step
        self.path = path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


def _train(
    ckpt_path: str | None = None, callbacks: list | None = None, seed: int = 7, num_workers: int = 0, **options: Any
) -> tuple[list[torch.Tensor], Any]:
    phalanx.seed_everything(seed)
    model = AdamWithScheduler(dropout=0.3)
    train, val = loaders(n=100, batch_size=8, shuffle=True, num_workers=num_workers)  # 13 batches, the last one short
    settings = dict(max_epochs=3, val_check_interval=0.5, callbacks=callbacks or [])
    settings.update(options)
    trainer = quiet_trainer(**settings)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return parameters_of(model), trainer


# 5: mid-epoch; 6: right after the mid-epoch validation; 13: last batch of epoch 0; 20: mid-epoch 1
@pytest.mark.parametrize("at_step", [5, 6, 13, 20])
def test_resume_mid_epoch_matches_uninterrupted_run_bit_for_bit(tmp_path, at_step):
    reference, reference_trainer = _train()
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _train(callbacks=[Interrupt(at_step, path)])
    # A different seed and fresh weights: everything must come from the checkpoint.
    resumed, trainer = _train(ckpt_path=path, seed=12345)
    assert trainer.global_step == reference_trainer.global_step == 39
    assert same_parameters(resumed, reference)


def test_resume_with_dataloader_workers_matches(tmp_path):
    reference, _ = _train(num_workers=1, max_epochs=2)
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _train(callbacks=[Interrupt(9, path)], num_workers=1, max_epochs=2)
    resumed, _ = _train(ckpt_path=path, seed=99, num_workers=1, max_epochs=2)
    assert same_parameters(resumed, reference)


def test_resume_detects_a_different_run(tmp_path):
    # The comparison above is meaningful only if a resumed run differs when the data order is not restored.
    reference, _ = _train()
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _train(callbacks=[Interrupt(5, path)])
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["loops"]["fit_loop"]["epoch_start_rng"] = None  # lose the epoch's shuffling order
    torch.save(checkpoint, path)
    resumed, _ = _train(ckpt_path=path, seed=12345)
    assert not same_parameters(resumed, reference)


def test_resume_after_max_steps_continues_where_it_stopped(tmp_path):
    reference, _ = _train(max_epochs=2)
    _, first = _train(max_steps=7, max_epochs=2)
    path = str(tmp_path / "after_fit.ckpt")
    first.save_checkpoint(path)
    resumed, trainer = _train(ckpt_path=path, seed=1, max_epochs=2)
    assert trainer.global_step == 26
    assert same_parameters(resumed, reference)


def test_resume_from_last_checkpoint_of_model_checkpoint(tmp_path):
    from phalanx.callbacks import ModelCheckpoint

    reference, _ = _train(max_epochs=3)
    checkpointing = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4, save_top_k=-1)
    with pytest.raises(KeyboardInterrupt):
        _train(
            callbacks=[checkpointing, Interrupt(18, str(tmp_path / "unused.ckpt"))],
            enable_checkpointing=True,
            max_epochs=3,
        )
    # last.ckpt was written at step 16; a fresh Trainer with a ModelCheckpoint on the same directory finds it.
    resumed, trainer = _train(
        ckpt_path="last",
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        enable_checkpointing=True,
        seed=5,
        max_epochs=3,
    )
    assert trainer.global_step == 39
    assert same_parameters(resumed, reference)


class PlateauModel(AdamWithScheduler):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"}


class InterruptAfterValidation(phalanx.Callback):
    def __init__(self, at_step: int, path: str) -> None:
        self.at_step = at_step
        self.path = path

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.global_step == self.at_step and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "at_step", [6, 12]
)  # after a mid-epoch validation; after the epoch-end validation (12 batches)
def test_resume_from_a_checkpoint_saved_at_validation_end_with_a_plateau_scheduler(tmp_path, at_step):
    def train(**kwargs: Any) -> tuple[list[torch.Tensor], Any]:
        seed = kwargs.pop("seed", 7)
        phalanx.seed_everything(seed)
        model = PlateauModel(dropout=0.3)
        trainer = quiet_trainer(max_epochs=3, val_check_interval=0.5, **kwargs.pop("trainer", {}))
        trainer.fit(model, *loaders(n=96, batch_size=8), **kwargs)
        return parameters_of(model), trainer

    reference, reference_trainer = train()
    path = str(tmp_path / "at_validation.ckpt")
    with pytest.raises(KeyboardInterrupt):
        train(trainer={"callbacks": [InterruptAfterValidation(at_step, path)]})
    resumed, trainer = train(ckpt_path=path, seed=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference_trainer.optimizers[0].param_groups[0]["lr"] < 0.05
    assert same_parameters(resumed, reference)
