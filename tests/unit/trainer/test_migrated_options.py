"""Trainer options a migrated Lightning config uses: overfit_batches, reload_dataloaders_every_n_epochs, barebones,
and the num_devices / device_ids / accelerator / precision_plugin properties."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from phalanx_testing import quiet_trainer
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import phalanx
from phalanx.accelerators.cpu import CPUAccelerator
from phalanx.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, TQDMProgressBar
from phalanx.loggers import CSVLogger
from phalanx.plugins.precision import DoublePrecision, MixedPrecision, Precision
from phalanx.utilities.exceptions import MisconfigurationError


def numbered(n: int, offset: int = 0) -> TensorDataset:
    """Samples whose single feature is their number (``offset`` + index), so a batch says which samples it holds."""
    x = torch.arange(offset, offset + n, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, x.clone())


class Recorder(phalanx.TrainingModule):
    """Records the sample numbers of every training and validation batch, per epoch; counts dataloader requests."""

    def __init__(self, train: Any = None, val: Any = None, log: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.train_data, self.val_data, self.log_it = train, val, log
        self.seen: dict[str, dict[int, list[list[int]]]] = {"train": {}, "val": {}}
        self.requests = {"train": 0, "val": 0}

    def _record(self, stage: str, batch: Any) -> None:
        self.seen[stage].setdefault(self.current_epoch, []).append([int(v) for v in batch[0].flatten()])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("train", batch)
        loss = nn.functional.mse_loss(self.layer(batch[0] / 1000), batch[1] / 1000)  # sample numbers reach 4000
        if self.log_it:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self._record("val", batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Reloading(Recorder):
    """train_dataloader()/val_dataloader() give new data on every call: call k holds samples 1000*k, 1000*k+1, ..."""

    def train_dataloader(self) -> DataLoader:
        self.requests["train"] += 1
        return DataLoader(numbered(8, 1000 * self.requests["train"]), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        self.requests["val"] += 1
        return DataLoader(numbered(4, 1000 * self.requests["val"]), batch_size=4)


# ---------------------------------------------------------------------------- overfit_batches
OVERFIT = [
    # (overfit_batches, extra Trainer options, training batches per epoch, validation batches)
    (2, {}, 2, 2),
    (0.25, {}, 2, 1),  # a fraction of the 8 training and of the 4 validation batches
    (1, {"limit_train_batches": 5, "limit_val_batches": 3}, 1, 1),  # overfit_batches wins over the limits
    (3, {"fast_dev_run": 5}, 3, 3),  # and over fast_dev_run's batches for training and validation
]


@pytest.mark.parametrize(("overfit", "options", "train_batches", "val_batches"), OVERFIT)
def test_overfit_batches_train_and_validate_on_the_same_first_batches_every_epoch(
    overfit, options, train_batches, val_batches
):
    train = DataLoader(numbered(64), batch_size=8, shuffle=True)
    val = DataLoader(numbered(32, offset=500), batch_size=8, sampler=RandomSampler(numbered(32, offset=500)))
    model = Recorder()
    trainer = quiet_trainer(overfit_batches=overfit, max_epochs=3, num_sanity_val_steps=0, **options)
    with pytest.warns(UserWarning, match="overfit_batches") as caught:
        trainer.fit(model, train, val)
    stages = {
        stage
        for stage in ("training", "validation")
        if any(f"the {stage} DataLoader" in str(w.message) for w in caught)
    }
    assert stages == {"training", "validation"}  # both shuffled loaders were replaced, each with a warning
    epochs = sorted(model.seen["train"])
    expected_train = [list(range(8 * b, 8 * b + 8)) for b in range(train_batches)]
    expected_val = [list(range(500 + 8 * b, 508 + 8 * b)) for b in range(val_batches)]
    for epoch in epochs:
        assert model.seen["train"][epoch] == expected_train  # the first batches, in order, every epoch
        assert model.seen["val"][epoch] == expected_val  # validation uses the validation data, not the training data
    assert len(epochs) == (1 if options.get("fast_dev_run") else 3)


def test_overfit_batches_leave_sequential_loaders_alone_and_off_means_shuffling():
    model = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replacement warning for loaders already in order
        quiet_trainer(overfit_batches=2, max_epochs=1, num_sanity_val_steps=0).fit(
            model, DataLoader(numbered(64), batch_size=8)
        )
    assert model.seen["train"][0] == [list(range(8)), list(range(8, 16))]
    torch.manual_seed(0)
    shuffled = Recorder()
    quiet_trainer(max_epochs=2, limit_train_batches=2).fit(
        shuffled, DataLoader(numbered(64), batch_size=8, shuffle=True)
    )
    assert shuffled.seen["train"][0] != shuffled.seen["train"][1]  # overfit_batches=0 (default) keeps the shuffle


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, r"overfit_batches=-1 must be >= 0"),
        (1.5, ValueError, r"overfit_batches=1.5 must be in \[0.0, 1.0\]"),
        ("2", TypeError, r"overfit_batches='2' must be an int"),
        (True, TypeError, "overfit_batches=True"),
        (None, TypeError, "overfit_batches=None"),
    ],
)
def test_bad_overfit_batches_name_the_argument_and_the_valid_range(value, error, match):
    with pytest.raises(error, match=match):
        quiet_trainer(overfit_batches=value)


def test_overfit_batches_refuse_a_batch_sampler_they_cannot_make_sequential():
    class Custom(BatchSampler):
        pass

    data = numbered(16)
    loader = DataLoader(data, batch_sampler=Custom(RandomSampler(data), batch_size=4, drop_last=False))
    with pytest.raises(ValueError, match=r"overfit_batches=2 .* custom batch_sampler \(Custom\)"):
        quiet_trainer(overfit_batches=2, max_epochs=1).fit(Recorder(), loader)


# ---------------------------------------------------------------------------- reload_dataloaders_every_n_epochs
RELOAD = [
    # (every n epochs, max_epochs, check_val_every_n_epoch, train_dataloader() calls, val_dataloader() calls)
    (0, 4, 1, 1, 1),
    (1, 4, 1, 4, 4),
    (2, 5, 1, 3, 3),  # epochs 0, 2, 4
    (1, 4, 2, 4, 3),  # validation runs in epochs 1 and 3 only: built for the sanity check, then at 1 and 3
    (3, 2, 1, 1, 1),
]


@pytest.mark.parametrize(("every", "epochs", "check_val", "train_calls", "val_calls"), RELOAD)
def test_reload_dataloaders_asks_the_source_again_every_n_epochs(every, epochs, check_val, train_calls, val_calls):
    model = Reloading()
    trainer = quiet_trainer(
        reload_dataloaders_every_n_epochs=every, max_epochs=epochs, check_val_every_n_epoch=check_val
    )
    trainer.fit(model)
    assert model.requests == {"train": train_calls, "val": val_calls}
    for epoch, batches in model.seen["train"].items():
        build = epoch // every + 1 if every else 1  # the call that built this epoch's loader
        assert batches == [[1000 * build + i for i in range(4)], [1000 * build + 4 + i for i in range(4)]]
    assert sorted(model.seen["train"]) == list(range(epochs))


def test_reload_dataloaders_with_a_datamodule_source():
    class Data(phalanx.DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def train_dataloader(self) -> DataLoader:
            self.calls += 1
            return DataLoader(numbered(4, 100 * self.calls), batch_size=4)

    data, model = Data(), Recorder()
    quiet_trainer(reload_dataloaders_every_n_epochs=1, max_epochs=3).fit(model, datamodule=data)
    assert data.calls == 3
    assert [batches[0][0] for _, batches in sorted(model.seen["train"].items())] == [100, 200, 300]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_bad_reload_dataloaders_every_n_epochs_names_the_argument(value):
    with pytest.raises(ValueError, match=r"reload_dataloaders_every_n_epochs=.* it must be an int >= 0"):
        quiet_trainer(reload_dataloaders_every_n_epochs=value)


# ---------------------------------------------------------------------------- barebones
REFUSED_WITH_BAREBONES = [
    ({"enable_checkpointing": True}, "enable_checkpointing=True"),
    ({"logger": True}, "logger=True"),
    ({"logger": "csv-logger"}, "logger=<phalanx.loggers.csv.CSVLogger"),
    ({"log_every_n_steps": 10}, "log_every_n_steps=10"),
    ({"enable_progress_bar": True}, "enable_progress_bar=True"),
    ({"enable_model_summary": True}, "enable_model_summary=True"),
    ({"num_sanity_val_steps": 2}, "num_sanity_val_steps=2"),
    ({"num_sanity_val_steps": -1}, "num_sanity_val_steps=-1"),
    ({"fast_dev_run": True}, "fast_dev_run=True"),
    ({"fast_dev_run": 3}, "fast_dev_run=3"),
    ({"detect_anomaly": True}, "detect_anomaly=True"),
    ({"callbacks": "checkpoint"}, "holds a ModelCheckpoint"),
    ({"callbacks": "progress"}, "holds a TQDMProgressBar"),
]


@pytest.mark.parametrize(("options", "match"), REFUSED_WITH_BAREBONES)
def test_barebones_refuses_a_feature_turned_on_explicitly(tmp_path, options, match):
    named = {
        "csv-logger": CSVLogger(save_dir=tmp_path),
        "checkpoint": [ModelCheckpoint(dirpath=tmp_path)],
        "progress": TQDMProgressBar(),
    }
    options = {key: named.get(value, value) if isinstance(value, str) else value for key, value in options.items()}
    with pytest.raises(ValueError, match=rf"barebones=True.*{match}|{match}.*barebones"):
        phalanx.Trainer(barebones=True, accelerator="cpu", default_root_dir=tmp_path, **options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_checkpointing": False, "logger": False, "enable_progress_bar": False, "enable_model_summary": False},
        {"num_sanity_val_steps": 0, "log_every_n_steps": None, "fast_dev_run": False, "logger": None},
        {"callbacks": [ModelSummary()]},
    ],
)
def test_barebones_turns_every_overhead_off(tmp_path, options):
    trainer = phalanx.Trainer(barebones=True, accelerator="cpu", default_root_dir=tmp_path, max_epochs=2, **options)
    assert trainer.barebones is True and trainer.loggers == [] and trainer.checkpoint_callback is None
    assert not any(isinstance(cb, ProgressBar) for cb in trainer.callbacks)
    assert trainer.num_sanity_val_steps == 0 and trainer.log_every_n_steps == 0
    model = Recorder()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, DataLoader(numbered(16), batch_size=4), DataLoader(numbered(8), batch_size=4))
    assert trainer.global_step == 8 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sorted(model.seen["val"]) == [0, 1]  # validation runs (only the sanity check is off)
    assert os.listdir(tmp_path) == []  # no logs, no checkpoints


def test_barebones_makes_self_log_raise(tmp_path):
    trainer = phalanx.Trainer(barebones=True, accelerator="cpu", default_root_dir=tmp_path, max_epochs=1)
    with pytest.raises(
        MisconfigurationError,
        match=r"self.log\('train_loss', ...\) was called in training_step, but Trainer\(barebones=True\)",
    ):
        trainer.fit(Recorder(log=True), DataLoader(numbered(8), batch_size=4))
    assert issubclass(MisconfigurationError, ValueError)


def test_logger_none_is_the_default_logger_as_in_lightning(tmp_path):
    assert [
        type(logger) for logger in phalanx.Trainer(logger=None, accelerator="cpu", default_root_dir=tmp_path).loggers
    ] == [CSVLogger]
    assert phalanx.Trainer(logger=False, accelerator="cpu", default_root_dir=tmp_path).loggers == []


# ---------------------------------------------------------------------------- properties
PROPERTIES = [
    # (Trainer options, num_devices, device_ids, accelerator type, precision plugin type)
    ({}, 1, [0], CPUAccelerator, Precision),
    ({"precision": "64-true"}, 1, [0], CPUAccelerator, DoublePrecision),
    ({"precision": "bf16-mixed"}, 1, [0], CPUAccelerator, MixedPrecision),
    ({"devices": 2, "strategy": "ddp"}, 2, [0, 1], CPUAccelerator, Precision),
    ({"devices": 3, "strategy": "ddp_spawn", "num_nodes": 2}, 3, [0, 1, 2], CPUAccelerator, Precision),
]


@pytest.mark.parametrize(("options", "num_devices", "device_ids", "accelerator", "plugin"), PROPERTIES)
def test_device_and_plugin_properties_come_from_the_strategy(options, num_devices, device_ids, accelerator, plugin):
    trainer = quiet_trainer(**options)
    assert trainer.num_devices == num_devices and trainer.device_ids == device_ids
    assert type(trainer.accelerator) is accelerator and trainer.accelerator is trainer.strategy.accelerator
    assert type(trainer.precision_plugin) is plugin and trainer.precision_plugin is trainer.strategy.precision_plugin
