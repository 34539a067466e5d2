"""What ``self.log`` records (phalanx.trainer.logging.results), end to end through a Trainer, as Lightning 2.6 names and
keeps it: a value per hook and name, step values in validation and test, and the refusal of step values where a hook
has no step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch.utils.data import DataLoader

from phalanx.callbacks import Callback, LearningRateMonitor
from phalanx.loggers import Logger


class Recorder(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        self.records: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((dict(metrics), step))

    def log_hyperparams(self, params: Any) -> None:
        pass

    def points(self, name: str) -> list[tuple[int | None, float]]:
        return [(step, metrics[name]) for metrics, step in self.records if name in metrics]


# ------------------------------------------------------------------ a name logged again at the epoch's end (item 13)

EPOCH_END_CASES = [
    # (options in the step hook, callback metrics after fit, logged at the epoch's end)
    ({}, {"loss": 100.0}, {"loss": 100.0}),
    ({"on_step": True, "on_epoch": True}, {"loss": 100.0, "loss_epoch": 1.5, "loss_step": 3.0}, {"loss": 100.0}),
    ({"on_step": False, "on_epoch": True}, {"loss": 100.0}, {"loss": 100.0}),
]


class EpochEndLogger(Callback):
    def on_train_epoch_end(self, trainer, module):
        module.log("loss", 100.0)


@pytest.mark.parametrize("from_callback", [False, True])
@pytest.mark.parametrize(("options", "callback", "logged"), EPOCH_END_CASES)
def test_a_name_logged_again_in_on_train_epoch_end_replaces_the_step_value(options, callback, logged, from_callback):
    class Relogging(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("loss", float(batch_idx), **options)
            return super().training_step(batch, batch_idx)

    if not from_callback:
        Relogging.on_train_epoch_end = lambda self: self.log("loss", 100.0)
    recorder = Recorder()
    callbacks = [EpochEndLogger()] if from_callback else []
    trainer = quiet_trainer(max_epochs=1, logger=recorder, log_every_n_steps=1, callbacks=callbacks)
    trainer.fit(Relogging(), loaders(n=32, batch_size=8)[0])  # 4 batches: steps 0..3, the epoch logged at 3
    assert {name: trainer.callback_metrics[name].item() for name in callback} == callback
    epoch_end = recorder.records[-1]
    assert {name: epoch_end[0][name] for name in logged} == logged and epoch_end[1] == 3  # Lightning: the last step


@pytest.mark.parametrize(
    ("stage", "epoch_hook"), [("validate", "on_validation_epoch_end"), ("test", "on_test_epoch_end")]
)
def test_a_name_logged_again_at_an_evaluation_epoch_end_replaces_the_aggregate(stage, epoch_hook):
    name = "val_acc" if stage == "validate" else "test_acc"

    class Relogging(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log(name, 1.0)

        test_step = validation_step

    setattr(Relogging, epoch_hook, lambda self: self.log(name, 7.0))
    trainer = quiet_trainer()
    results = getattr(trainer, stage)(Relogging(), loaders()[1], verbose=False)
    assert results == [{name: 7.0}]
    assert trainer.callback_metrics[name].item() == 7.0


# ------------------------------------------------------------------ step values in validation and test (item 4)

EVAL_CASES = [
    # (options, what validate() returns, callback metric names, logged step name)
    ({"on_step": True, "on_epoch": True}, {"val_loss_epoch"}, {"val_loss", "val_loss_epoch"}, "val_loss_step"),
    ({"on_step": True, "on_epoch": False}, set(), set(), "val_loss"),
    ({}, {"val_loss"}, {"val_loss"}, None),
    ({"on_step": True, "on_epoch": True, "logger": False}, set(), {"val_loss", "val_loss_epoch"}, None),
]


@pytest.mark.parametrize(("options", "returned", "callback", "step_name"), EVAL_CASES)
@pytest.mark.parametrize("stage", ["validate", "test"])
def test_step_values_in_validation_and_test_are_logged_per_batch(stage, options, returned, callback, step_name):
    prefix = "val" if stage == "validate" else "test"

    class StepLogging(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log(f"{prefix}_loss", float(batch_idx), **options)

        test_step = validation_step

    recorder = Recorder()
    trainer = quiet_trainer(logger=recorder)
    for _ in range(2):  # each call counts its batches from 0 again
        recorder.records.clear()
        results = getattr(trainer, stage)(StepLogging(), DataLoader(torch.zeros(40, 4), batch_size=8), verbose=False)
        assert set(results[0]) == {name.replace("val", prefix) for name in returned}
        assert set(trainer.callback_metrics) == {name.replace("val", prefix) for name in callback}
        if step_name is None:
            assert all(step == 0 for _, step in recorder.records)  # only the epoch's values, at global step 0
            continue
        step_name = step_name.replace("val", prefix)
        assert recorder.points(step_name) == [(batch, float(batch)) for batch in range(5)]
        step_records = [metrics for metrics, _ in recorder.records if step_name in metrics]
        assert all("epoch" not in metrics for metrics in step_records)  # Lightning sends no epoch with them
        assert step_name in trainer.logged_metrics and step_name not in trainer.callback_metrics


def test_validation_step_values_count_on_across_a_fit_and_per_dataloader():
    class StepLogging(Regressor):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_loss", float(10 * dataloader_idx + batch_idx), on_step=True, on_epoch=True)

    recorder = Recorder()
    train, _ = loaders(n=32, batch_size=8)
    two = [DataLoader(torch.zeros(16, 4), batch_size=8), DataLoader(torch.zeros(24, 4), batch_size=8)]
    trainer = quiet_trainer(max_epochs=2, logger=recorder, num_sanity_val_steps=2)
    trainer.fit(StepLogging(), train, two)
    # the sanity check logs nothing; each validation goes on counting where the previous one ended
    assert recorder.points("val_loss_step/dataloader_idx_0") == [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]
    assert recorder.points("val_loss_step/dataloader_idx_1") == [(step, 10.0 + step % 3) for step in range(6)]
    assert [step for step, _ in recorder.points("val_loss_epoch/dataloader_idx_1")] == [3, 7]


@pytest.mark.parametrize(
    "hook",
    ["on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_validation_epoch_start",
     "on_validation_epoch_end", "on_validation_start"],
)  # fmt: skip
def test_on_step_in_a_hook_without_steps_is_refused(hook):
    class EpochStepLogging(Regressor):
        pass

    setattr(EpochStepLogging, hook, lambda self: self.log("x", 1.0, on_step=True))
    train, val = loaders(n=16, batch_size=8)
    with pytest.raises(ValueError, match=rf"self.log\('x', \.\.\., on_step=True\) in {hook}: that hook runs once"):
        quiet_trainer(max_epochs=1, num_sanity_val_steps=0).fit(EpochStepLogging(), train, val)


# ------------------------------------------------------------------ log_every_n_steps counts optimizer steps (item 4)

CADENCE_CASES = [
    # (accumulate_grad_batches, log_every_n_steps, max_epochs, loggers' steps of train_loss); 8 batches an epoch
    (1, 2, 1, [1, 3, 5, 7]),
    (2, 2, 1, [1, 3]),
    (2, 1, 1, [0, 1, 2, 3]),
    (3, 1, 2, [0, 1, 2, 3, 4, 5]),  # windows end at batches 3, 6 and 8 of each epoch
    (4, 3, 3, [2, 5]),
]


@pytest.mark.parametrize(("accumulate", "every", "epochs", "steps"), CADENCE_CASES)
def test_log_every_n_steps_counts_optimizer_steps_in_step_with_the_lr_monitor(accumulate, every, epochs, steps):
    recorder = Recorder()
    trainer = quiet_trainer(
        max_epochs=epochs, accumulate_grad_batches=accumulate, log_every_n_steps=every, logger=recorder,
        callbacks=[LearningRateMonitor(logging_interval="step")],
    )  # fmt: skip
    trainer.fit(Regressor(), loaders(n=64, batch_size=8)[0])
    assert [step for step, _ in recorder.points("train_loss")] == steps
    assert [step for step, _ in recorder.points("lr-SGD")] == steps
    assert trainer.fit_loop.batches_stepped == trainer.global_step


RESUME_CASES = [
    # (ModelCheckpoint options, Trainer options, checkpoint resumed from); 4 batches an epoch, 2 epochs
    ({"every_n_train_steps": 3}, {}, "epoch=0-step=3.ckpt"),  # in on_train_batch_end
    ({}, {"val_check_interval": 0.5}, "epoch=0-step=2.ckpt"),  # after a validation inside the epoch
    ({}, {}, "epoch=0-step=4.ckpt"),  # at the training epoch's end
    ({"save_on_train_epoch_end": False}, {}, "epoch=0-step=4.ckpt"),  # after the epoch's validation
]


@pytest.mark.parametrize(("checkpoint", "options", "name"), RESUME_CASES)
def test_a_resumed_fit_logs_at_the_steps_of_an_uninterrupted_one(tmp_path, checkpoint, options, name):
    from phalanx.callbacks import ModelCheckpoint

    def run(recorder: Recorder, **extra: Any) -> Any:
        callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **checkpoint)
        trainer = quiet_trainer(
            max_epochs=2, log_every_n_steps=1, logger=recorder, callbacks=[callback], enable_checkpointing=True,
            num_sanity_val_steps=0, **options,
        )  # fmt: skip
        train, val = loaders(n=32, batch_size=8, shuffle=False)
        trainer.fit(Regressor(), train, val, **extra)
        return trainer

    whole, resumed = Recorder(), Recorder()
    run(whole)
    trainer = run(resumed, ckpt_path=str(tmp_path / name))
    first = resumed.records[0][1]
    for metric in ("train_loss", "val_loss"):
        assert [s for s, _ in resumed.points(metric)] == [s for s, _ in whole.points(metric) if s >= first]
    assert trainer.fit_loop.batches_stepped == trainer.global_step == 8


def test_skipped_steps_keep_the_lr_monitor_in_step_with_the_metrics():
    class NanAtBatch2(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == 2 else loss

    recorder = Recorder()
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=2, logger=recorder, nonfinite_loss="skip",
        callbacks=[LearningRateMonitor(logging_interval="step")],
    )  # fmt: skip
    trainer.fit(NanAtBatch2(), loaders(n=64, batch_size=8)[0])
    assert trainer.global_step == 7  # batch 2 took no optimizer step
    assert [step for step, _ in recorder.points("train_loss")] == [1, 3, 5, 7]
    assert [step for step, _ in recorder.points("lr-SGD")] == [1, 3, 5, 7]
