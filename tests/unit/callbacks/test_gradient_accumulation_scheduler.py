"""GradientAccumulationScheduler: Lightning 2.6's weights for a table of schedules (defaults on for one), its
arguments and refusals, and a run resumed between scheduled windows that ends as an uninterrupted one."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, parameters_of, quiet_trainer, regression_data, same_parameters
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import GradientAccumulationScheduler
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities.exceptions import MisconfigurationError


def _loader(shuffle: bool = False) -> DataLoader:
    return DataLoader(regression_data(40), batch_size=4, shuffle=shuffle)  # 10 batches an epoch


def _lightning_twin(pl: Any, model: Regressor) -> Any:
    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(model.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=model.hparams.lr)

    return Twin()


SCHEDULES = [{0: 2}, {1: 3}, {0: 4, 2: 1}, {0: 1, 1: 2, 2: 3}, {2: 10}]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_a_schedule_trains_as_lightnings(tmp_path, schedule):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    phalanx.seed_everything(0)
    model = Regressor()
    twin = _lightning_twin(pl, model)
    ours = quiet_trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler(dict(schedule))])
    ours.fit(model, _loader())
    theirs = pl.Trainer(
        accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[pl.callbacks.GradientAccumulationScheduler(dict(schedule))],
    )  # fmt: skip
    theirs.fit(twin, _loader())
    assert ours.global_step == theirs.global_step
    assert ours.accumulate_grad_batches == theirs.accumulate_grad_batches
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(parameters_of(model), parameters_of(twin)))


def test_with_the_trainers_defaults_on_it_steps_as_scheduled(tmp_path):
    steps: list[int] = []

    class Steps(phalanx.Callback):
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            steps.append(trainer.global_step)

    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=3, default_root_dir=tmp_path,
        callbacks=[GradientAccumulationScheduler({1: 2, 2: 5}), Steps()],
    )  # fmt: skip
    trainer.fit(Regressor(), _loader(), DataLoader(regression_data(8), batch_size=4))
    assert steps == [10, 15, 17]
    assert [path.name for path in tmp_path.rglob("*.ckpt")] == ["epoch=2-step=17.ckpt"]


@pytest.mark.parametrize(
    ("scheduling", "error", "message"),
    [
        ({}, TypeError, "is empty"),
        ({-1: 2}, MisconfigurationError, "every epoch must be an int >= 0"),
        ({1.0: 2}, MisconfigurationError, "every epoch must be an int >= 0"),
        ({0: 0}, MisconfigurationError, "every number of batches must be an int >= 1"),
        ({0: 2.0}, MisconfigurationError, "every number of batches must be an int >= 1"),
        ({0: True}, MisconfigurationError, "every number of batches must be an int >= 1"),
    ],
    ids=["empty", "negative epoch", "float epoch", "zero batches", "float batches", "bool batches"],
)
def test_bad_scheduling_is_refused(scheduling, error, message):
    with pytest.raises(error, match=message):
        GradientAccumulationScheduler(scheduling)


@pytest.mark.parametrize(("epoch", "expected"), [(0, 1), (1, 1), (2, 3), (4, 3), (5, 2), (100, 2)])
def test_the_window_of_an_epoch_is_the_latest_scheduled_at_or_before_it(epoch, expected):
    scheduling = {2: 3, 5: 2}
    scheduler = GradientAccumulationScheduler(scheduling)
    assert scheduling == {0: 1, 2: 3, 5: 2}  # the caller's dict gains epoch 0, as in Lightning
    assert scheduler.get_accumulate_grad_batches(epoch) == expected
    assert scheduler.going_to_accumulate_grad_batches()


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
    ("model", "options", "error", "message"),
    [
        (Manual, {}, RuntimeError, "with self.automatic_optimization = False accumulate in training_step"),
        (Regressor, {"strategy": AccumulatesItself()}, RuntimeError, "cannot change the accumulation between epochs"),
        (Regressor, {"accumulate_grad_batches": 2}, ValueError, "both set the accumulation; remove one of them"),
    ],
    ids=["manual optimization", "a strategy that accumulates itself", "Trainer(accumulate_grad_batches=2)"],
)
def test_a_run_the_schedule_cannot_drive_is_refused_before_training(model, options, error, message):
    trained: list[int] = []

    class Record(phalanx.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            trained.append(trainer.global_step)

    trainer = quiet_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler({0: 2}), Record()], **options)
    with pytest.raises(error, match=message):
        trainer.fit(model(), _loader())
    assert trained == []


class StepOverride(Regressor):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


@pytest.mark.parametrize(("scheduling", "warns"), [({0: 2}, True), ({0: 1}, False)])
def test_an_overridden_optimizer_step_is_warned_about_only_when_accumulating(scheduling, warns, recwarn):
    quiet_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler(scheduling)]).fit(StepOverride(), _loader())
    messages = [str(w.message) for w in recwarn]
    assert any("overrides optimizer_step" in m for m in messages) == warns, messages


class Interrupt(phalanx.Callback):
    """Saves a checkpoint after batch ``at_batch`` (counted over the fit) and stops the run."""

    def __init__(self, at_batch: int, path: str) -> None:
        self.at_batch, self.path, self.seen = at_batch, path, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == self.at_batch:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


def _scheduled_fit(ckpt_path: str | None = None, callbacks: tuple = (), seed: int = 3) -> tuple[list, int]:
    phalanx.seed_everything(seed)
    model = Regressor()
    trainer = quiet_trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler({1: 3, 2: 2}), *callbacks])
    trainer.fit(model, _loader(shuffle=True), ckpt_path=ckpt_path)
    return parameters_of(model), trainer.global_step


# After batch 13: the first 3-batch window of epoch 1 (mid-epoch: on_train_epoch_start does not run again); 16: its
# second; 20: the last batch of epoch 1 (a short window of 1); 24: two 2-batch windows into epoch 2. A checkpoint
# inside a window does not hold the gradients accumulated so far (nor does Lightning's), so each point ends a window.
@pytest.mark.parametrize("at_batch", [13, 16, 20, 24])
def test_a_resume_inside_the_schedule_ends_as_the_uninterrupted_run(tmp_path, at_batch):
    reference, steps = _scheduled_fit()
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _scheduled_fit(callbacks=(Interrupt(at_batch, path),))
    resumed, resumed_steps = _scheduled_fit(ckpt_path=path, seed=99)
    assert resumed_steps == steps == 10 + 4 + 5
    assert same_parameters(resumed, reference)
