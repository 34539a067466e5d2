"""What Lightning's hook order and lifecycle let a project rely on, checked on phalanx's behaviour: a finetuning
callback that adds a parameter group resumes, per-epoch callback state survives a resume inside an epoch, monitoring
callbacks see what the module logs in ``on_train_epoch_end``, and each checkpoint asks each callback for its state
once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.utilities.exceptions import CheckpointError


def _loader() -> DataLoader:
    return DataLoader(regression_data(32), batch_size=8)  # 4 batches an epoch


class TwoPart(phalanx.TrainingModule):
    """A backbone trained only once a finetuning callback adds it to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.relu(self.backbone(x))), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.head(torch.relu(self.backbone(x))), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)


class Unfreeze(phalanx.Callback):
    """Lightning's ``BaseFinetuning`` pattern: add the backbone as a parameter group at ``unfreeze_at``; keep the
    groups' parameter names in the checkpoint and rebuild the groups in ``on_fit_start`` of a resumed run, before
    the Trainer loads the optimizer state, which holds them."""

    def __init__(self, unfreeze_at: int = 1) -> None:
        self.unfreeze_at = unfreeze_at
        self.restored: list[list[str]] | None = None

    def on_train_epoch_start(self, trainer: Any, module: TwoPart) -> None:
        optimizer = trainer.optimizers[0]
        if trainer.current_epoch == self.unfreeze_at and len(optimizer.param_groups) == 1:
            optimizer.add_param_group({"params": list(module.backbone.parameters()), "lr": 0.01})

    def state_dict(self) -> dict[str, Any]:
        module = self._module
        names = {id(p): n for n, p in module.named_parameters()}
        return {"groups": [[names[id(p)] for p in g["params"]] for g in self._trainer.optimizers[0].param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = state_dict["groups"]

    def setup(self, trainer: Any, module: TwoPart, stage: str) -> None:
        self._trainer, self._module = trainer, module

    def on_fit_start(self, trainer: Any, module: TwoPart) -> None:
        if self.restored is None:
            return
        parameters = dict(module.named_parameters())
        optimizer = trainer.optimizers[0]
        for names in self.restored[len(optimizer.param_groups) :]:
            optimizer.add_param_group({"params": [parameters[n] for n in names], "lr": 0.01})


def _saved_after_unfreezing(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[Unfreeze()])
    model = TwoPart()
    trainer.fit(model, _loader())
    path = str(tmp_path / "unfrozen.ckpt")
    trainer.save_checkpoint(path)
    momentum = {n: trainer.optimizers[0].state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    return path, momentum


def test_a_finetuning_callback_that_added_a_parameter_group_resumes(tmp_path):
    path, momentum = _saved_after_unfreezing(tmp_path)
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[Unfreeze()])
    model = TwoPart()
    trainer.fit(model, _loader(), ckpt_path=path)  # trains nothing more: the optimizer state is restored, and kept
    optimizer = trainer.optimizers[0]
    assert [len(group["params"]) for group in optimizer.param_groups] == [2, 2]
    for name, parameter in model.named_parameters():
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], momentum[name]), name


class FitStartWatcher(phalanx.Callback):
    def on_fit_start(self, trainer: Any, module: Any) -> None:
        pass  # an on_fit_start hook that changes nothing: a state that does not fit is refused after it


@pytest.mark.parametrize("with_fit_start_hook", [False, True])
def test_an_optimizer_state_that_never_fits_is_refused_before_or_after_on_fit_start(tmp_path, with_fit_start_hook):
    path, _ = _saved_after_unfreezing(tmp_path)
    model = TwoPart()
    before = [p.detach().clone() for p in model.parameters()]
    callbacks = [FitStartWatcher()] if with_fit_start_hook else []
    with pytest.raises(CheckpointError, match=r"\['param_groups'\] holds 2 parameter group\(s\), but the SGD has 1"):
        quiet_trainer(default_root_dir=tmp_path, max_epochs=3, callbacks=callbacks).fit(
            model, _loader(), ckpt_path=path
        )
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Without an on_fit_start hook nothing was restored; with one, the weights were, as that hook sees them.
    assert unchanged is not with_fit_start_hook


class PerEpochCount(phalanx.Callback):
    """Counts the batches of the current epoch, reset in on_train_epoch_start, kept in checkpoints."""

    def __init__(self) -> None:
        self.batches = 0
        self.per_epoch: list[int] = []

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.per_epoch.append(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


class SaveAt(phalanx.Callback):
    """Saves a checkpoint in on_train_batch_end at ``step``, or in on_validation_end after it (inside an epoch)."""

    def __init__(self, path: str, step: int, where: str) -> None:
        self.path, self.step, self.where = path, step, where

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "on_train_batch_end" and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if self.where == "on_validation_end" and trainer.global_step == self.step and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("where", ["on_train_batch_end", "on_validation_end"])
def test_a_resume_inside_an_epoch_keeps_the_epochs_callback_state(tmp_path, where):
    path = str(tmp_path / "inside.ckpt")
    data = DataLoader(regression_data(16), batch_size=8)
    options = dict(default_root_dir=tmp_path, val_check_interval=2, limit_val_batches=1)
    first = PerEpochCount()
    quiet_trainer(max_epochs=1, callbacks=[first, SaveAt(path, 2, where)], **options).fit(
        TwoPart(), _loader(), val_dataloaders=data
    )
    resumed = PerEpochCount()
    quiet_trainer(max_epochs=2, callbacks=[resumed], **options).fit(
        TwoPart(), _loader(), val_dataloaders=data, ckpt_path=path
    )
    assert first.per_epoch == [4]
    assert resumed.per_epoch == [4, 4]  # the 2 batches before the checkpoint count in the resumed epoch


class LogsAtEpochEnd(TwoPart):
    def on_train_epoch_end(self) -> None:
        self.log("epoch_score", 1.0)  # the same every epoch: never an improvement


class SeesScore(phalanx.Callback):
    """A callback that is not a monitoring one: its on_train_epoch_end runs before the module's."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.seen.append("epoch_score" in trainer.callback_metrics)


@pytest.mark.parametrize("monitoring", ["EarlyStopping", "ModelCheckpoint"])
def test_monitoring_callbacks_see_what_the_module_logs_in_on_train_epoch_end(tmp_path, monitoring):
    monitors: dict[str, phalanx.Callback] = {
        "EarlyStopping": EarlyStopping(monitor="epoch_score", patience=1, check_on_train_epoch_end=True),
        "ModelCheckpoint": ModelCheckpoint(dirpath=tmp_path, monitor="epoch_score", save_on_train_epoch_end=True),
    }
    callback, reader = monitors[monitoring], SeesScore()
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_epochs=4,
        callbacks=[callback, reader],  # the monitoring callback first: it still runs after the module
        enable_checkpointing=monitoring == "ModelCheckpoint",
    )
    trainer.fit(LogsAtEpochEnd(), _loader())
    if monitoring == "EarlyStopping":
        assert trainer.current_epoch == 2  # no improvement after epoch 0: stopped after epoch 1
    else:
        assert float(callback.best_model_score) == 1.0
    assert reader.seen[0] is False  # as in Lightning, a plain callback runs before the module logs it


class CountsStateDict(phalanx.Callback):
    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"calls": self.calls}


@pytest.mark.parametrize(
    ("options", "saves"),
    [
        ({"enable_checkpointing": False}, 0),
        ({"callbacks": [ModelCheckpoint(save_top_k=-1)], "enable_checkpointing": True}, 2),
        ({"callbacks": [ModelCheckpoint(save_top_k=-1, save_last=True)], "enable_checkpointing": True}, 2),
        ({"callbacks": [ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)], "enable_checkpointing": True}, 4),
    ],
    ids=["no checkpoint", "each epoch", "each epoch and last", "every 2 steps"],
)
def test_each_checkpoint_asks_each_callback_for_its_state_once(tmp_path, options, saves):
    counter = CountsStateDict()
    options = dict(options)
    options["callbacks"] = [counter, *options.get("callbacks", [])]
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=2, **options)
    trainer.fit(TwoPart(), _loader())
    assert counter.calls == saves
    trainer.save_checkpoint(tmp_path / "extra.ckpt")
    assert counter.calls == saves + 1
    assert torch.load(tmp_path / "extra.ckpt", weights_only=True)["callbacks"]["CountsStateDict"] == {
        "calls": saves + 1
    }
