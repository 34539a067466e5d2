"""TrainingModule: hyper-parameters, loading from checkpoints, logging outside a run, and its helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx


def test_save_hyperparameters_collects_init_arguments():
    model = Regressor(hidden=8, lr=0.3)
    assert model.hparams == {"features": 4, "hidden": 8, "lr": 0.3, "dropout": 0.0}
    assert model.hparams.lr == 0.3
    with pytest.raises(AttributeError, match="saved"):
        _ = model.hparams.missing


def test_save_hyperparameters_with_names_ignore_kwargs_and_dict():
    class Selective(phalanx.TrainingModule):
        def __init__(self, a: int, b: str = "x", *, c: float = 1.0, **rest):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert Selective(1, c=2.0).hparams == {"a": 1, "c": 2.0}

    class Ignoring(phalanx.TrainingModule):
        def __init__(self, a: int, net: torch.nn.Module, **rest):
            super().__init__()
            self.save_hyperparameters(ignore="net")

    assert Ignoring(1, torch.nn.Linear(1, 1), extra=5).hparams == {"a": 1, "extra": 5}

    class FromDict(phalanx.TrainingModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"width": 3})

    assert FromDict().hparams.width == 3

    class Unknown(phalanx.TrainingModule):
        def __init__(self, a: int = 1):
            super().__init__()
            self.save_hyperparameters("b")

    with pytest.raises(ValueError, match="not arguments of __init__"):
        Unknown()


def test_load_from_checkpoint_rebuilds_with_hparams_and_overrides(tmp_path):
    model = Regressor(hidden=12, lr=0.2)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(model, loaders()[0])
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = Regressor.load_from_checkpoint(path)
    assert loaded.hparams.hidden == 12
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    overridden = Regressor.load_from_checkpoint(path, lr=0.9)
    assert overridden.hparams.lr == 0.9 and overridden.hparams.hidden == 12


def test_non_plain_hyperparameters_are_left_out_of_checkpoints_with_a_warning(tmp_path):
    class WithModule(Regressor):
        def __init__(self, backbone: torch.nn.Module | None = None, lr: float = 0.1):
            super().__init__(lr=lr)
            self.save_hyperparameters()

    trainer = quiet_trainer(max_steps=1)
    trainer.fit(WithModule(backbone=torch.nn.Linear(1, 1)), loaders()[0])
    with pytest.warns(UserWarning, match="backbone"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    saved = torch.load(tmp_path / "x.ckpt", weights_only=True)["hyper_parameters"]
    assert "backbone" not in saved and saved["lr"] == 0.1


def test_log_outside_a_trainer_warns_and_trainer_property_raises():
    model = Regressor()
    with pytest.warns(UserWarning, match="outside a Trainer"):
        model.log("x", 1.0)
    with pytest.raises(RuntimeError, match="not attached"):
        _ = model.trainer
    assert model.global_rank == 0 and model.current_epoch == 0 and model.global_step == 0


def test_device_print_and_all_gather(capsys):
    class Probe(Regressor):
        def training_step(self, batch, batch_idx):
            gathered = self.all_gather({"x": torch.tensor([1.0, 2.0])})
            assert torch.equal(gathered["x"], torch.tensor([1.0, 2.0]))  # one process: unchanged
            self.print("device", self.device)
            return super().training_step(batch, batch_idx)

    quiet_trainer(max_steps=1).fit(Probe(), loaders()[0])
    assert "device cpu" in capsys.readouterr().out


def test_lr_schedulers_and_optimizers_accessors():
    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.seen = None

        def training_step(self, batch, batch_idx):
            self.seen = (self.optimizers(), self.lr_schedulers())
            optimizer = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5)
            optimizer.step()
            self.lr_schedulers().step()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    model = Manual()
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(model, loaders()[0])
    optimizer, scheduler = model.seen
    assert optimizer.optimizer is trainer.optimizers[0]
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25


def test_manual_backward_is_refused_in_automatic_optimization():
    class Wrong(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            return loss

    with pytest.raises(RuntimeError, match="automatic_optimization = False"):
        quiet_trainer(max_steps=1).fit(Wrong(), loaders()[0])


def test_import_phalanx_is_cheap():
    # Heavy optional modules must load only when used.
    code = (
        "import sys, phalanx; "
        "heavy = [m for m in ('tensorboard', 'torch.utils.tensorboard', 'phalanx.loggers.tensorboard', 'phalanx.demo',"
        " 'deepspeed') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_subpackages_are_reachable_as_attributes_and_load_lazily():
    # Lightning users write `pl.callbacks.ModelCheckpoint(...)` after `import lightning.pytorch as pl`.
    code = (
        "import sys, phalanx; "
        "before = 'phalanx.callbacks' in sys.modules; "
        "names = [phalanx.callbacks.ModelCheckpoint.__name__, phalanx.loggers.CSVLogger.__name__, "
        "phalanx.strategies.DDPStrategy.__name__, phalanx.plugins.TorchCheckpointIO.__name__, "
        "phalanx.accelerators.CPUAccelerator.__name__, phalanx.utilities.__name__]; "
        "print(before, ','.join(names), 'callbacks' in dir(phalanx))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [
        "False",
        "ModelCheckpoint,CSVLogger,DDPStrategy,TorchCheckpointIO,CPUAccelerator,phalanx.utilities",
        "True",
    ]
    with pytest.raises(AttributeError, match="no attribute 'calbacks'"):
        phalanx.calbacks  # noqa: B018
