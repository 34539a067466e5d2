"""DeviceStatsMonitor: Lightning's metric names at Lightning's steps on the CPU with the Trainer's defaults, its
``cpu_stats`` switch, its refusals at set-up, and the CUDA statistics where CUDA is available."""

from __future__ import annotations

import csv
import inspect
import sys
from pathlib import Path

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import DeviceStatsMonitor
from phalanx.loggers import CSVLogger


def _steps_by_name(metrics_csv: Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None) and name.startswith("DeviceStatsMonitor."):
                    steps.setdefault(name, []).append(int(row["step"]))
    return steps


def _values(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(v) for row in csv.DictReader(f) for k, v in row.items() if k.startswith("DeviceStats") and v]


def _lightning_module():
    pl = pytest.importorskip("pytorch_lightning")  # the oracle, where it is installed

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Regressor().net

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return pl, Module()


def test_the_trainers_defaults_log_lightnings_names_at_lightnings_steps(tmp_path):
    pytest.importorskip("psutil")
    pl, lightning_module = _lightning_module()
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=2, log_every_n_steps=3, default_root_dir=tmp_path / "phalanx",
        callbacks=[DeviceStatsMonitor()],
    )  # fmt: skip
    trainer.fit(Regressor(), *loaders())
    theirs = pl.Trainer(
        accelerator="cpu", max_epochs=2, log_every_n_steps=3, default_root_dir=tmp_path / "lightning",
        logger=pl.loggers.CSVLogger(tmp_path / "lightning"), callbacks=[pl.callbacks.DeviceStatsMonitor()],
    )  # fmt: skip
    theirs.fit(lightning_module, *loaders())
    ours_csv, theirs_csv = Path(trainer.log_dir) / "metrics.csv", Path(theirs.log_dir) / "metrics.csv"
    expected = _steps_by_name(theirs_csv)
    assert "DeviceStatsMonitor.on_validation_batch_end/cpu_percent" in expected
    assert _steps_by_name(ours_csv) == expected
    assert all(0.0 <= value <= 100.0 for value in _values(ours_csv))


def test_cpu_stats_false_logs_nothing_on_the_cpu(tmp_path):
    trainer = quiet_trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                            callbacks=[DeviceStatsMonitor(cpu_stats=False)])  # fmt: skip
    trainer.fit(Regressor(), loaders()[0])
    metrics = Path(trainer.log_dir) / "metrics.csv"
    assert not metrics.exists() or _steps_by_name(metrics) == {}


def test_a_trainer_without_a_logger_is_refused_at_set_up():
    trainer = quiet_trainer(max_epochs=1, callbacks=[DeviceStatsMonitor()])
    with pytest.raises(ValueError, match="DeviceStatsMonitor needs a logger"):
        trainer.fit(Regressor(), loaders()[0])


@pytest.mark.parametrize("cpu_stats", [None, True])
def test_monitoring_the_cpu_without_psutil_is_refused_at_set_up(tmp_path, monkeypatch, cpu_stats):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    trainer = quiet_trainer(max_epochs=1, logger=CSVLogger(tmp_path), callbacks=[DeviceStatsMonitor(cpu_stats)])
    with pytest.raises(ModuleNotFoundError, match="pip install psutil, or pass cpu_stats=False"):
        trainer.fit(Regressor(), loaders()[0])


def test_a_bad_cpu_stats_is_refused():
    with pytest.raises(TypeError, match="cpu_stats='yes' is not valid"):
        DeviceStatsMonitor(cpu_stats="yes")


def test_the_constructor_takes_lightnings_arguments():
    callbacks = pytest.importorskip("pytorch_lightning.callbacks")
    ours = inspect.signature(DeviceStatsMonitor).parameters
    assert list(ours) == list(inspect.signature(callbacks.DeviceStatsMonitor).parameters) == ["cpu_stats"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_statistics_are_logged(tmp_path):
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, logger=CSVLogger(tmp_path),
                            log_every_n_steps=1, callbacks=[DeviceStatsMonitor(cpu_stats=True)])  # fmt: skip
    trainer.fit(Regressor(), loaders()[0])
    names = _steps_by_name(Path(trainer.log_dir) / "metrics.csv")
    assert "DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.current" in names
    assert "DeviceStatsMonitor.on_train_batch_end/cpu_percent" in names
