import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from phalanx.callbacks import LearningRateMonitor


class RecordingLogger:
    def __init__(self):
        self.records = []

    def log_metrics(self, metrics, step=None):
        self.records.append((dict(metrics), step))


def config(scheduler, interval="epoch", name=None):
    return SimpleNamespace(scheduler=scheduler, interval=interval, name=name)


def make_trainer(optimizers, configs=(), loggers=None, **kwargs):
    defaults = dict(
        optimizers=list(optimizers),
        lr_scheduler_configs=list(configs),
        loggers=[RecordingLogger()] if loggers is None else loggers,
        fit_loop=SimpleNamespace(batches_stepped=0),
        should_stop=False,
        log_every_n_steps=2,
    )
    defaults.update(kwargs)
    return SimpleNamespace(**defaults)


def params(n=1):
    return [nn.Parameter(torch.zeros(2)) for _ in range(n)]


def test_no_logger_raises():
    monitor = LearningRateMonitor()
    trainer = make_trainer([torch.optim.SGD(params(), lr=0.1)], loggers=[])
    with pytest.raises(RuntimeError, match="logger"):
        monitor.on_train_start(trainer, None)


def test_invalid_interval():
    with pytest.raises(ValueError, match="step"):
        LearningRateMonitor(logging_interval="batch")


def test_names_duplicates_param_groups_and_config_name():
    sgd = torch.optim.SGD(params(), lr=0.1)
    adam_a = torch.optim.Adam(params(), lr=0.01)
    adam_b = torch.optim.Adam([{"params": params()}, {"params": params(), "lr": 0.5}], lr=0.02)
    named = torch.optim.SGD(params(), lr=0.3)
    configs = [config(torch.optim.lr_scheduler.StepLR(named, 1), name="my-lr")]
    trainer = make_trainer([sgd, adam_a, adam_b, named], configs)
    monitor = LearningRateMonitor(logging_interval="epoch")
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    metrics, step = trainer.loggers[0].records[-1]
    assert step == 0
    assert metrics == pytest.approx(
        {"my-lr": 0.3, "lr-SGD": 0.1, "lr-Adam": 0.01, "lr-Adam-1/pg1": 0.02, "lr-Adam-1/pg2": 0.5}
    )
    assert set(monitor.lrs) == set(metrics)


def test_param_group_names_are_used():
    optimizer = torch.optim.SGD(
        [{"params": params(), "name": "backbone"}, {"params": params(), "name": "head"}], lr=0.1
    )
    trainer = make_trainer([optimizer])
    monitor = LearningRateMonitor(logging_interval="epoch")
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    assert set(trainer.loggers[0].records[-1][0]) == {"lr-SGD/backbone", "lr-SGD/head"}


def test_step_interval_follows_log_every_n_steps():
    optimizer = torch.optim.SGD(params(), lr=0.1)
    trainer = make_trainer([optimizer], log_every_n_steps=3)
    monitor = LearningRateMonitor(logging_interval="step")
    monitor.on_train_start(trainer, None)
    for step in range(9):
        trainer.fit_loop.batches_stepped = step
        monitor.on_train_batch_start(trainer, None, None, step)
        monitor.on_train_batch_start(trainer, None, None, step)  # accumulation: same step twice, logged once
    monitor.on_train_epoch_start(trainer, None)  # 'step' ignores epochs
    assert [step for _, step in trainer.loggers[0].records] == [2, 5, 8]


def test_default_interval_follows_each_scheduler():
    step_opt = torch.optim.SGD(params(), lr=1.0)
    epoch_opt = torch.optim.Adam(params(), lr=2.0)
    plain = torch.optim.RMSprop(params(), lr=3.0)
    configs = [
        config(torch.optim.lr_scheduler.StepLR(step_opt, 1, gamma=0.5), interval="step"),
        config(torch.optim.lr_scheduler.StepLR(epoch_opt, 1, gamma=0.5), interval="epoch"),
    ]
    trainer = make_trainer([step_opt, epoch_opt, plain], configs, log_every_n_steps=1)
    monitor = LearningRateMonitor()
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_batch_start(trainer, None, None, 0)
    epoch_record, step_record = trainer.loggers[0].records
    assert set(epoch_record[0]) == {"lr-Adam", "lr-RMSprop"}
    assert set(step_record[0]) == {"lr-SGD"}

    step_opt.step()
    configs[0].scheduler.step()
    trainer.fit_loop.batches_stepped = 1
    monitor.on_train_batch_start(trainer, None, None, 1)
    assert trainer.loggers[0].records[-1] == ({"lr-SGD": 0.5}, 1)


def test_momentum_and_weight_decay():
    sgd = torch.optim.SGD(params(), lr=0.1, momentum=0.9, weight_decay=0.01)
    adam = torch.optim.Adam(params(), lr=0.1, betas=(0.8, 0.99))
    trainer = make_trainer([sgd, adam])
    monitor = LearningRateMonitor(logging_interval="epoch", log_momentum=True, log_weight_decay=True)
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    metrics = trainer.loggers[0].records[-1][0]
    assert metrics["lr-SGD-momentum"] == pytest.approx(0.9)
    assert metrics["lr-SGD-weight_decay"] == pytest.approx(0.01)
    assert metrics["lr-Adam-momentum"] == pytest.approx(0.8)
    assert metrics["lr-Adam-weight_decay"] == 0.0


def test_every_logger_receives_the_metrics():
    loggers = [RecordingLogger(), RecordingLogger()]
    trainer = make_trainer(
        [torch.optim.SGD(params(), lr=0.1)], loggers=loggers, fit_loop=SimpleNamespace(batches_stepped=4)
    )
    monitor = LearningRateMonitor(logging_interval="epoch")
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    assert loggers[0].records == loggers[1].records == [({"lr-SGD": pytest.approx(0.1)}, 4)]


# ---------------------------------------------------------------------- with the real Trainer

import csv  # noqa: E402

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402
from phalanx.loggers import CSVLogger  # noqa: E402


class Scheduled(phalanx.TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def test_lr_is_written_to_the_logger(tmp_path):
    logger = CSVLogger(tmp_path)
    trainer = phalanx.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[LearningRateMonitor()],
    )
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer.fit(Scheduled(), train_dataloaders=loader)
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("lr-SGD")]
    assert [float(row["lr-SGD"]) for row in rows] == pytest.approx([0.1, 0.05, 0.025])
    assert [int(row["step"]) for row in rows] == [0, 2, 4]


def test_trainer_without_logger_fails_fast(tmp_path):
    trainer = phalanx.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[LearningRateMonitor()],
    )
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    with pytest.raises(RuntimeError, match="logger"):
        trainer.fit(Scheduled(), train_dataloaders=loader)


class _Wrapper:
    """What a strategy may hold in ``trainer.optimizers`` (DeepSpeed's engine optimizer): the scheduled optimizer's
    parameter groups, under another class."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


@pytest.mark.parametrize("name", [None, "custom"])
@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_a_wrapped_scheduled_optimizer_is_logged_once_under_its_own_name(optimizer_class, name):
    optimizer = optimizer_class(params(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    trainer = make_trainer([_Wrapper(optimizer)], [config(scheduler, interval="step", name=name)])
    monitor = LearningRateMonitor(logging_interval="epoch")
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    metrics, _step = trainer.loggers[0].records[-1]
    assert list(metrics) == [name or f"lr-{optimizer_class.__name__}"]
    assert set(monitor.lrs) == set(metrics)


def test_an_unscheduled_optimizer_beside_a_wrapped_one_is_still_logged():
    scheduled, plain = torch.optim.AdamW(params(), lr=0.1), torch.optim.SGD(params(), lr=0.2)
    scheduler = torch.optim.lr_scheduler.StepLR(scheduled, 1)
    trainer = make_trainer([_Wrapper(scheduled), plain], [config(scheduler)])
    monitor = LearningRateMonitor(logging_interval="epoch")
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    assert trainer.loggers[0].records[-1][0] == pytest.approx({"lr-AdamW": 0.1, "lr-SGD": 0.2})
