"""StochasticWeightAveraging: Lightning 2.6's weights, batch-norm statistics, learning rates and step counts for a
table of settings (defaults on for one), its refusals, and runs resumed in the middle of the averaging (between
epochs, inside an epoch, inside the batch-norm epoch) that end as an uninterrupted one."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from phalanx_testing import quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import StochasticWeightAveraging
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities.exceptions import MisconfigurationError

EPOCHS = 5


def _loader(shuffle: bool = False) -> DataLoader:
    return DataLoader(regression_data(24), batch_size=4, shuffle=shuffle)  # 6 batches an epoch


def _net(batch_norm: bool) -> nn.Sequential:
    norm = nn.BatchNorm1d(8) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Linear(4, 8), norm, nn.ReLU(), nn.Linear(8, 1))


def _configure(module: nn.Module, scheduler: str | None) -> Any:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    if scheduler is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


class Model(phalanx.TrainingModule):
    def __init__(self, batch_norm: bool = True, scheduler: str | None = None) -> None:
        super().__init__()
        self.net, self.scheduler = _net(batch_norm), scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return _configure(self, self.scheduler)


def _lightning_twin(pl: Any, model: Model) -> Any:
    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(model.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return _configure(self, model.scheduler)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if self.trainer.fit_loop._skip_backward:
                # Lightning ends the batch-norm epoch with an optimizer step on the gradients left from the last
                # training step, which moves the weights off the average; phalanx keeps the average (see
                # docs/migrating-from-lightning.md). Without that step the two are equal.
                optimizer_closure()
                return
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    return Twin()


class Record(phalanx.Callback):
    """The learning rate each epoch trains with (read in the first batch, after every epoch-start hook)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _lightning_record(pl: Any) -> Any:
    class LightningRecord(pl.Callback):
        def __init__(self) -> None:
            self.lrs: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    return LightningRecord()


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [tensor.detach().clone().float() for tensor in module.state_dict().values()]


SETTINGS = [
    ({"swa_lrs": 0.02}, True, None),
    ({"swa_lrs": 0.02}, False, None),
    ({"swa_lrs": 0.01, "swa_epoch_start": 2, "annealing_epochs": 2}, True, "step_lr"),
    ({"swa_lrs": [0.03], "swa_epoch_start": 0.4, "annealing_strategy": "linear", "annealing_epochs": 1}, True, None),
    ({"swa_lrs": 0.02, "swa_epoch_start": 3, "device": None}, False, "step_lr"),
    ({"swa_lrs": 0.02, "swa_epoch_start": 1, "avg_fn": lambda avg, new, n: 0.5 * avg + 0.5 * new}, True, None),
]
IDS = ["defaults, batch norm", "defaults, no batch norm", "a scheduler swapped", "linear, a fraction", "device=None",
       "avg_fn"]  # fmt: skip


@pytest.mark.parametrize(("options", "batch_norm", "scheduler"), SETTINGS, ids=IDS)
def test_the_average_and_its_schedule_are_lightnings(tmp_path, options, batch_norm, scheduler):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    phalanx.seed_everything(0)
    model = Model(batch_norm, scheduler)
    twin = _lightning_twin(pl, model)
    ours, theirs = Record(), _lightning_record(pl)
    trainer = quiet_trainer(max_epochs=EPOCHS, callbacks=[StochasticWeightAveraging(**options), ours])
    trainer.fit(model, _loader())
    lightning = pl.Trainer(
        accelerator="cpu", max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[pl.callbacks.StochasticWeightAveraging(**options), theirs],
    )  # fmt: skip
    lightning.fit(twin, _loader())
    assert ours.lrs == pytest.approx(theirs.lrs, rel=1e-6) and len(ours.lrs) == EPOCHS + batch_norm
    assert (trainer.global_step, trainer.current_epoch) == (lightning.global_step, lightning.current_epoch)
    assert trainer.max_epochs == lightning.max_epochs == EPOCHS
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_state(model), _state(twin)))
    schedulers = trainer.lr_scheduler_configs, lightning.lr_scheduler_configs
    assert [c.scheduler.state_dict() for c in schedulers[0]] == [c.scheduler.state_dict() for c in schedulers[1]]
    if batch_norm:
        assert model.net[1].momentum == 0.1  # given back after the batch-norm epoch


def test_with_the_trainers_defaults_on_the_average_is_in_the_saved_checkpoint(tmp_path):
    phalanx.seed_everything(0)
    model = Model()
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=3, default_root_dir=tmp_path,
        callbacks=[StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)],
    )  # fmt: skip
    trainer.fit(model, _loader(), DataLoader(regression_data(8), batch_size=4))
    (path,) = tmp_path.rglob("*.ckpt")
    state = next(v for k, v in torch.load(path, weights_only=True)["callbacks"].items() if "StochasticWeight" in k)
    assert state["n_averaged"] == 2 and state["latest_update_epoch"] == 2
    # The checkpoint is saved at the end of the batch-norm epoch (3, whose one step changes no weight, as in
    # Lightning): it holds the average with the batch-norm statistics recomputed for it, as the module does.
    assert path.name == "epoch=3-step=19.ckpt" and trainer.current_epoch == 4
    average = state["average_model_state"]
    assert all(torch.equal(average[name], p.detach()) for name, p in model.named_parameters())
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())
    assert model.net[1].num_batches_tracked == 6  # recomputed over the batch-norm epoch's 6 batches


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"swa_lrs": 0}, "swa_lrs=0 must be a positive float"),
        ({"swa_lrs": [0.1, -1.0]}, "must be a positive float or a list of positive floats"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 0}, "swa_epoch_start=0 must be an int >= 1 or a float in"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "swa_epoch_start=1.5 must be an int >= 1 or a float in"),
        ({"swa_lrs": 0.1, "annealing_epochs": -1}, "annealing_epochs=-1 must be an int >= 0"),
        ({"swa_lrs": 0.1, "annealing_strategy": "exp"}, "annealing_strategy='exp' must be 'cos' or 'linear'"),
        ({"swa_lrs": 0.1, "avg_fn": 3}, "avg_fn=3 must be callable"),
        ({"swa_lrs": 0.1, "device": 0}, "device=0 must be a torch.device, a str or None"),
    ],
    ids=lambda value: str(value)[:40],
)
def test_bad_arguments_are_refused(options, message):
    with pytest.raises(MisconfigurationError, match=message.replace("(", r"\(").replace("[", r"\[")):
        StochasticWeightAveraging(**options)


class TwoOptimizers(Model):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[3].parameters(), lr=0.1)]


class TwoSchedulers(Model):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, 1), torch.optim.lr_scheduler.StepLR(optimizer, 2)]
        return [optimizer], schedulers


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (TwoOptimizers, {}, "works with one optimizer; configure_optimizers returned 2"),
        (TwoSchedulers, {}, "works with at most one; configure_optimizers returned 2"),
        (Model, {"max_epochs": -1, "max_steps": 12}, "is a fraction of max_epochs, but max_epochs=-1 sets no limit"),
    ],
    ids=["two optimizers", "two schedulers", "a fraction without max_epochs"],
)
def test_a_run_it_cannot_average_is_refused_before_training(model, options, message):
    module = model()
    if model is TwoOptimizers:
        module.automatic_optimization = False
    trainer = quiet_trainer(**{"max_epochs": 2, **options}, callbacks=[StochasticWeightAveraging(swa_lrs=0.1)])
    with pytest.raises(MisconfigurationError, match=message):
        trainer.fit(module, _loader())
    assert trainer.global_step == 0 and trainer.max_epochs == options.get("max_epochs", 2)


class ShardsAtSetup(SingleDeviceStrategy):
    """A strategy that shards the model when it is set up (as FSDP, model_parallel and DeepSpeed do)."""

    def declare_traits(self) -> StrategyTraits:
        return replace(super().declare_traits(), restore_checkpoint_after_setup=True)


def test_a_strategy_that_shards_the_model_is_refused_at_setup():
    started: list[str] = []

    class Record(phalanx.Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            started.append("fit")

    trainer = quiet_trainer(
        max_epochs=2, strategy=ShardsAtSetup(), callbacks=[StochasticWeightAveraging(swa_lrs=0.1), Record()]
    )
    with pytest.raises(MisconfigurationError, match="does not support ShardsAtSetup, which shards the model"):
        trainer.fit(Model(), _loader())
    assert started == []


class Interrupt(phalanx.Callback):
    """Saves a checkpoint after batch ``at_batch`` (counted over the fit) and stops the run."""

    def __init__(self, at_batch: int, path: str) -> None:
        self.at_batch, self.path, self.seen = at_batch, path, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == self.at_batch:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


def _averaged_fit(ckpt_path: str | None = None, callbacks: tuple = (), seed: int = 5) -> tuple[list, Any]:
    phalanx.seed_everything(seed)
    model = Model(scheduler="step_lr")
    swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)
    trainer = quiet_trainer(max_epochs=4, callbacks=[swa, *callbacks])
    trainer.fit(model, _loader(shuffle=True), ckpt_path=ckpt_path)
    return _state(model), trainer


# After batch 4: inside epoch 0, before the averaging; 9: inside epoch 1, the first averaged; 12: the end of epoch 1;
# 20: inside epoch 3, the last averaged; 27: inside the batch-norm epoch (4), which trains no step
@pytest.mark.parametrize("at_batch", [4, 9, 12, 20, 27])
def test_a_resume_in_the_middle_of_the_averaging_ends_as_the_uninterrupted_run(tmp_path, at_batch):
    reference, finished = _averaged_fit()
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _averaged_fit(callbacks=(Interrupt(at_batch, path),))
    resumed, trainer = _averaged_fit(ckpt_path=path, seed=123)
    assert (trainer.global_step, trainer.current_epoch) == (finished.global_step, finished.current_epoch) == (25, 5)
    assert trainer.max_epochs == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference))
    assert trainer.optimizers[0].param_groups[0]["lr"] == finished.optimizers[0].param_groups[0]["lr"]
