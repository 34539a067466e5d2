"""``trainer.accumulate_grad_batches`` changed during fit (by a callback, as Lightning's GradientAccumulationScheduler
does) changes the accumulation window and divides the loss by the new window, as in Lightning."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, parameters_of, quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.traits import StrategyTraits


def _loader() -> DataLoader:
    return DataLoader(regression_data(32), batch_size=4)  # 8 batches an epoch


class Schedule(phalanx.Callback):
    """Sets ``trainer.accumulate_grad_batches`` at the start of the epochs named in ``schedule``."""

    def __init__(self, schedule: dict[int, int]) -> None:
        self.schedule = schedule

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch in self.schedule:
            trainer.accumulate_grad_batches = self.schedule[trainer.current_epoch]


def _trained(model: nn.Module, **options: Any) -> list[torch.Tensor]:
    quiet_trainer(max_epochs=2, num_sanity_val_steps=0, **options).fit(model, _loader())
    return parameters_of(model)


@pytest.mark.parametrize(
    ("initial", "new"), [(1, 2), (1, 3), (4, 2), (2, 1)], ids=["1 to 2", "1 to 3", "4 to 2", "2 to 1"]
)
def test_a_window_set_at_the_first_epoch_trains_as_that_window_from_the_start(initial, new):
    phalanx.seed_everything(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    scheduled = _trained(model, accumulate_grad_batches=initial, callbacks=[Schedule({0: new})])
    assert all(
        torch.allclose(a, b, atol=1e-7) for a, b in zip(scheduled, _trained(reference, accumulate_grad_batches=new))
    )


def _lightning_twin(pl: Any, phalanx_model: Regressor) -> Any:
    """A LightningModule with the same layers, weights and loss as ``phalanx_model``."""

    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(phalanx_model.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=phalanx_model.hparams.lr)

    return Twin()


@pytest.mark.parametrize("schedule", [{0: 2}, {0: 1, 1: 2}, {0: 3, 1: 1}, {1: 4}], ids=str)
def test_a_schedule_trains_as_lightnings_gradient_accumulation_scheduler(tmp_path, schedule):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning is the oracle of this test")
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    phalanx.seed_everything(0)
    model = Regressor()
    twin = _lightning_twin(pl, model)
    ours = _trained(model, callbacks=[Schedule(schedule)])
    pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[GradientAccumulationScheduler(scheduling={0: 1, **schedule})],
    ).fit(twin, _loader())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, parameters_of(twin)))


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", None])
def test_a_value_that_is_not_a_positive_int_is_refused(value):
    trainer = quiet_trainer()
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=.* is not valid; it must be an int >= 1"):
        trainer.accumulate_grad_batches = value
    assert trainer.accumulate_grad_batches == 1


class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


class AccumulatesItself(SingleDeviceStrategy):
    """A strategy that accumulates gradients itself (as DeepSpeed does), fixing the window when it is set up."""

    def declare_traits(self) -> StrategyTraits:
        return replace(super().declare_traits(), handles_gradient_accumulation=True)


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (Manual, {}, "accumulate_grad_batches is for automatic optimization"),
        (
            Regressor,
            {"strategy": AccumulatesItself()},
            "trainer.accumulate_grad_batches cannot change during fit with AccumulatesItself",
        ),
    ],
    ids=["manual optimization", "a strategy that accumulates itself"],
)
def test_a_change_during_fit_the_run_cannot_honour_is_refused(model, options, message):
    trainer = quiet_trainer(max_epochs=1, callbacks=[Schedule({0: 2})], **options)
    with pytest.raises(ValueError, match=message):
        trainer.fit(model(), _loader())
