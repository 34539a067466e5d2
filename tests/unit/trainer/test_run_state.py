"""The Trainer's per-run state is declared once, in RunState; a later stage resets what it reset before."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

# What a Trainer instance may hold: its resolved arguments, its collaborators and the one RunState. A per-run
# attribute assigned on the Trainer itself (instead of declared in RunState) makes this test fail.
SETTINGS = {
    "_max_time",
    "accumulate_grad_batches",
    "barebones",
    "callbacks",
    "check_val_every_n_epoch",
    "compile",
    "default_root_dir",
    "detect_anomaly",
    "deterministic",
    "fast_dev_run",
    "gradient_clip_algorithm",
    "gradient_clip_val",
    "inference_mode",
    "limit_predict_batches",
    "limit_test_batches",
    "limit_train_batches",
    "limit_val_batches",
    "log_every_n_steps",
    "loggers",
    "max_epochs",
    "max_steps",
    "min_epochs",
    "min_steps",
    "nonfinite_loss",
    "num_sanity_val_steps",
    "overfit_batches",
    "precision",
    "preemption",
    "profiler",
    "reload_dataloaders_every_n_epochs",
    "sync_batchnorm",
    "use_distributed_sampler",
    "val_check_interval",
}
COLLABORATORS = {
    "_checkpoint_connector",
    "_eval_results",
    "_hooks",
    "_metrics",
    "_run",
    "_train_results",
    "fit_loop",
    "state",
    "strategy",
}


class _Silent(Regressor):
    """Logs nothing, so that it runs under barebones=True too."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def test_step(self, batch, batch_idx):
        pass


def _loader(batches: int) -> DataLoader:
    return DataLoader(regression_data(8 * batches), batch_size=8)


def _run_stage(trainer, model, stage: str) -> None:
    if stage == "fit":
        trainer.fit(model, _loader(4), _loader(3))
    elif stage == "fit_again":
        trainer.fit(model, _loader(2), _loader(1))
    elif stage == "validate":
        trainer.validate(model, _loader(5), verbose=False)
    elif stage == "test":
        trainer.test(model, _loader(3), verbose=False)
    else:
        trainer.predict(model, _loader(6))


def _counts(trainer) -> tuple:
    return (
        trainer.num_training_batches,
        trainer.num_val_batches,
        trainer.num_sanity_val_batches,
        trainer.num_test_batches,
        trainer.num_predict_batches,
    )


@pytest.mark.parametrize("barebones", [False, True])
def test_no_per_run_attribute_lives_on_the_trainer_itself(barebones):
    trainer = quiet_trainer(max_epochs=1, barebones=barebones)
    model = _Silent()
    assert set(vars(trainer)) == SETTINGS | COLLABORATORS
    for stage in ("fit", "validate", "test", "predict"):
        _run_stage(trainer, model, stage)
        assert set(vars(trainer)) == SETTINGS | COLLABORATORS, stage
    from phalanx.trainer.state import RunState

    run_fields = {field.name for field in dataclasses.fields(RunState)}
    assert not run_fields & set(vars(trainer))


# Stages in order on one Trainer, and (num_training_batches, num_val_batches, num_sanity_val_batches,
# num_test_batches, num_predict_batches) after each: a stage sets the counts it runs and keeps the others.
ORDERS = [
    (
        ["fit", "fit_again"],
        [(4, [3], [2], [], []), (2, [1], [1], [], [])],
    ),
    (
        ["fit", "validate"],
        [(4, [3], [2], [], []), (4, [5], [2], [], [])],
    ),
    (
        ["validate", "fit"],
        [(0, [5], [], [], []), (4, [3], [2], [], [])],
    ),
    (
        ["fit", "test", "predict"],
        [(4, [3], [2], [], []), (4, [3], [2], [3], []), (4, [3], [2], [3], [6])],
    ),
    (
        ["fit", "validate", "fit_again"],
        [(4, [3], [2], [], []), (4, [5], [2], [], []), (2, [1], [1], [], [])],
    ),
]


@pytest.mark.parametrize(("stages", "expected"), ORDERS)
def test_each_stage_resets_what_it_reset_before(stages, expected):
    trainer = quiet_trainer(max_epochs=1)
    model = Regressor()
    assert _counts(trainer) == (0, [], [], [], [])
    for stage, counts in zip(stages, expected):
        trainer.should_stop = True  # a stop request left over: every stage starts without it
        _run_stage(trainer, model, stage)
        assert _counts(trainer) == counts, stage
        assert trainer.should_stop is False, stage
        assert trainer.preempted is False, stage


READ_ONLY = [
    "num_training_batches",
    "num_val_batches",
    "num_sanity_val_batches",
    "num_test_batches",
    "num_predict_batches",
    "validation_enabled",
    "preempted",
]
READ_WRITE = ["should_stop", "ckpt_path", "datamodule"]


@pytest.mark.parametrize("name", READ_ONLY + READ_WRITE)
def test_public_attributes_read_the_run_state(name):
    trainer = quiet_trainer()
    value = object()
    setattr(trainer._run, name, value)
    assert getattr(trainer, name) is value


@pytest.mark.parametrize("name", READ_ONLY)
def test_counts_and_flags_the_stages_set_are_read_only(name):
    trainer = quiet_trainer()
    with pytest.raises(AttributeError, match=f"trainer.{name} is set by the Trainer's stages"):
        setattr(trainer, name, 3)


@pytest.mark.parametrize("name", READ_WRITE)
def test_what_lightning_users_assign_writes_the_run_state(name):
    trainer = quiet_trainer()
    value = "chosen.ckpt" if name == "ckpt_path" else object()  # a checkpoint path is checked to be a path
    setattr(trainer, name, value)
    assert getattr(trainer._run, name) is value
