"""ThroughputMonitor: values on a clock the test controls (validation left out of training's time), the MFU from
torch's FLOP counter, Lightning's metric names at Lightning's steps with the Trainer's defaults on, and no host-device
synchronisation added to a step."""

from __future__ import annotations

import csv
import inspect
from pathlib import Path

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ThroughputMonitor
from phalanx.callbacks import throughput_monitor as monitor_module
from phalanx.loggers import CSVLogger
from phalanx.testing.step_counts import CountedModule, StepCountCallback, StepWindow, counted_data
from phalanx.utilities.throughput import measure_flops

BATCH = 8


def _batch_size(batch) -> int:
    return batch[0].size(0)


def _columns(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """Every logged value, by name, as (step, value) in the order written."""
    columns: dict[str, list[tuple[int, float]]] = {}
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None) and name != "step":
                    columns.setdefault(name, []).append((int(row["step"]), float(value)))
    return columns


class Counted(Regressor):
    """Knows its FLOPs per batch, counted by torch on a copy of itself on the meta device."""

    def setup(self, stage):
        with torch.device("meta"):
            copy, x = Regressor(), torch.randn(BATCH, 4)
        self.flops_per_batch = measure_flops(copy, lambda: copy(x), lambda y: y.sum())


@pytest.fixture
def clock(monkeypatch):
    """The monitor's host clock, made to advance 2 s at each reading."""
    readings = iter(range(2, 10_000, 2))
    monkeypatch.setattr(monitor_module, "_now", lambda: float(next(readings)))


def test_on_a_controlled_clock_the_rates_are_exact_and_validation_is_left_out(tmp_path, clock):
    monitor = ThroughputMonitor(batch_size_fn=_batch_size, window_size=2, available_flops=1e4)
    trainer = quiet_trainer(
        max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1, val_check_interval=4,
        limit_val_batches=2, callbacks=[monitor],
    )  # fmt: skip
    model = Counted()
    trainer.fit(model, *loaders(batch_size=BATCH))
    columns = _columns(Path(trainer.log_dir) / "metrics.csv")
    # Each batch reads the clock once, 2 s after the last reading: 2 s a batch, before and after the validation
    # after batch 4 (whose readings, its start, 2 batches and its end, are left out of training's time).
    assert [value for _, value in columns["train/time"]] == [2.0 * i for i in range(1, 9)]
    assert [value for _, value in columns["train/samples"]] == [BATCH * i for i in range(1, 9)]
    assert {value for _, value in columns["train/device/batches_per_sec"]} == {0.5}
    assert {value for _, value in columns["train/device/samples_per_sec"]} == {BATCH / 2}
    assert {value for _, value in columns["train/device/flops_per_sec"]} == {model.flops_per_batch / 2}
    assert {value for _, value in columns["train/device/mfu"]} == {model.flops_per_batch / 2 / 1e4}
    # Each validation (after batches 4 and 8) starts afresh, at step 1 (its batches' number, as in Lightning).
    assert columns["validate/time"] == [(1, 2.0), (2, 4.0), (1, 2.0), (2, 4.0)]
    assert columns["validate/device/batches_per_sec"] == [(2, 0.5), (2, 0.5)]
    assert "train/samples_per_sec" not in columns  # a world of one device: no world rates
    assert float(trainer.logged_metrics["train/samples"]) == 8 * BATCH


def test_the_flops_per_batch_are_the_flop_counters():
    model = Counted()
    model.setup("fit")
    with torch.device("meta"):
        copy, x = Regressor(), torch.randn(BATCH, 4)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        copy(x).sum().backward()
    assert model.flops_per_batch == counter.get_total_flops() > 0


def _lightning_fit(folder: Path) -> Path:
    pl = pytest.importorskip("pytorch_lightning")  # the oracle, where it is installed

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Regressor().net
            self.flops_per_batch = 100

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    length = lambda b: 3 * _batch_size(b)  # noqa: E731 - the same function as phalanx's run
    callback = pl.callbacks.ThroughputMonitor(batch_size_fn=_batch_size, length_fn=length, window_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, log_every_n_steps=3, default_root_dir=folder, callbacks=[callback],
        logger=pl.loggers.CSVLogger(folder), enable_progress_bar=True,
    )  # fmt: skip
    trainer.fit(Module(), *loaders(batch_size=BATCH))
    return Path(trainer.log_dir) / "metrics.csv"


class WithFlops(Regressor):
    def __init__(self):
        super().__init__()
        self.flops_per_batch = 100


def test_the_trainers_defaults_log_lightnings_names_at_lightnings_steps(tmp_path):
    theirs = _columns(_lightning_fit(tmp_path / "lightning"))
    monitor = ThroughputMonitor(batch_size_fn=_batch_size, length_fn=lambda b: 3 * _batch_size(b), window_size=2)
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=2, log_every_n_steps=3, default_root_dir=tmp_path / "phalanx", callbacks=[monitor]
    )
    trainer.fit(WithFlops(), *loaders(batch_size=BATCH))
    ours = _columns(Path(trainer.log_dir) / "metrics.csv")
    names = {name for name in theirs if name.startswith(("train/", "validate/"))}
    assert {name for name in ours if name.startswith(("train/", "validate/"))} == names
    assert "train/device/items_per_sec" in names and "validate/device/flops_per_sec" in names
    for name in names:
        assert [step for step, _ in ours[name]] == [step for step, _ in theirs[name]], name
        if not name.endswith(("time", "_per_sec")):  # counts, not timings
            assert [value for _, value in ours[name]] == [value for _, value in theirs[name]], name


def test_the_constructor_takes_lightnings_arguments():
    callbacks = pytest.importorskip("pytorch_lightning.callbacks")
    ours = inspect.signature(ThroughputMonitor).parameters
    assert list(ours) == list(inspect.signature(callbacks.ThroughputMonitor).parameters)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(window=3), TypeError, r"unknown keyword arguments \['window'\]"),
        (dict(window_size=1), ValueError, "window_size=1 is not valid"),
        (dict(batch_size_fn=8), TypeError, "batch_size_fn .* must be functions of a batch"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, message):
    kwargs = {"batch_size_fn": _batch_size, **kwargs}
    with pytest.raises(error, match=message):
        ThroughputMonitor(**kwargs)


def test_without_a_logger_it_measures_nothing():
    monitor = ThroughputMonitor(batch_size_fn=_batch_size, window_size=2)
    quiet_trainer(max_epochs=1, callbacks=[monitor]).fit(Regressor(), loaders()[0])
    assert monitor._stages["train"].batches == 0


def test_test_and_predict_are_measured_too(tmp_path):
    monitor = ThroughputMonitor(batch_size_fn=_batch_size, window_size=2)
    trainer = quiet_trainer(logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[monitor])
    data = DataLoader(loaders()[0].dataset, batch_size=BATCH)
    trainer.test(Regressor(), data, verbose=False)
    trainer.predict(Regressor(), data)
    columns = _columns(Path(trainer.log_dir) / "metrics.csv")
    assert [value for _, value in columns["test/samples"]] == [BATCH * i for i in range(1, 9)]
    assert [step for step, _ in columns["predict/batches"]] == list(range(1, 9))


def _count_syncs(folder: Path, *monitors) -> tuple[float, dict[str, list]]:
    """Syncs per step of a fit that logs every step (the Trainer itself reads its non-finite check then)."""
    window = StepWindow(warmup=2, steps=4)
    trainer = phalanx.Trainer(
        accelerator="cpu", max_steps=window.total_steps, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=CSVLogger(folder), enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[StepCountCallback(window), *monitors],
    )  # fmt: skip
    trainer.fit(CountedModule("none"), counted_data(window))
    metrics = Path(trainer.log_dir) / "metrics.csv"
    return window.result().syncs, _columns(metrics) if metrics.exists() else {}


def test_monitoring_adds_no_host_device_synchronisation_to_a_step(tmp_path):
    pytest.importorskip("psutil")  # DeviceStatsMonitor's CPU statistics
    monitors = (ThroughputMonitor(batch_size_fn=_batch_size, window_size=2), phalanx.callbacks.DeviceStatsMonitor())
    syncs, columns = _count_syncs(tmp_path / "monitored", *monitors)
    assert "train/device/samples_per_sec" in columns and "DeviceStatsMonitor.on_train_batch_end/cpu_percent" in columns
    assert syncs == _count_syncs(tmp_path / "plain")[0]
