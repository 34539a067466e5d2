"""The measuring toolkit on CUDA (skipped elsewhere): ThroughputMonitor's event clock adds no host-device sync per step,
DeviceStatsMonitor logs the allocator's statistics, PyTorchProfiler's trace holds the GPU kernels, and a torchmetrics
object logged from a CUDA module gives its epoch value."""

from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import DeviceStatsMonitor, ThroughputMonitor
from phalanx.loggers import CSVLogger
from phalanx.profilers import PyTorchProfiler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _columns(metrics_csv: Path) -> dict[str, list[float]]:
    columns: dict[str, list[float]] = collections.defaultdict(list)
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None) and name != "step":
                    columns[name].append(float(value))
    return columns


class _SyncCounter(phalanx.Callback):
    """Counts waits for the device (torch.cuda.synchronize, Event.synchronize, Stream.synchronize) from the first
    training batch to the end of training."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.active = False
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):  # fmt: skip
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.calls += self.active
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.active = True

    def on_train_end(self, trainer, module):
        self.active = False


def test_throughput_monitor_times_cuda_steps_with_events_and_no_synchronize(tmp_path, monkeypatch):
    counter = _SyncCounter(monkeypatch)
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    trainer = quiet_trainer(
        accelerator="cuda", devices=1, max_steps=16, logger=CSVLogger(tmp_path), log_every_n_steps=8,
        callbacks=[monitor, counter],
    )  # fmt: skip
    trainer.fit(Regressor(), loaders(n=256)[0])
    columns = _columns(Path(trainer.log_dir) / "metrics.csv")
    assert columns["train/samples"][-1] == 16 * 8
    assert all(value > 0 for value in columns["train/device/samples_per_sec"])
    # One wait per logger write at most (the monitor reads its last event there), never one per step.
    assert counter.calls <= 16 // 8, counter.calls


def test_device_stats_monitor_logs_the_cuda_allocator(tmp_path):
    trainer = quiet_trainer(
        accelerator="cuda", devices=1, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        callbacks=[DeviceStatsMonitor()],
    )  # fmt: skip
    trainer.fit(Regressor(), loaders()[0])
    columns = _columns(Path(trainer.log_dir) / "metrics.csv")
    allocated = columns["DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.current"]
    assert allocated and all(value > 0 for value in allocated)


def test_pytorch_profiler_trace_holds_the_gpu_kernels(tmp_path):
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="perf")
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_steps=6, profiler=profiler)
    trainer.fit(Regressor(), loaders()[0])
    traces = sorted(tmp_path.glob("fit-perf*.pt.trace.json"))
    assert traces, list(tmp_path.iterdir())
    events = json.loads(traces[0].read_text())["traceEvents"]
    categories = collections.Counter(event.get("cat") for event in events)
    assert categories["kernel"] > 0, categories  # the GPU side was recorded, not only the host's operators
    names = {event.get("name") for event in events}
    assert "[pl][profile][Strategy]SingleDeviceStrategy.backward" in names


def test_a_metric_object_on_cuda_logs_its_epoch_value(tmp_path):
    torchmetrics = pytest.importorskip("torchmetrics")

    class Scored(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.error = torchmetrics.MeanAbsoluteError()
            self.targets: list[torch.Tensor] = []
            self.predictions: list[torch.Tensor] = []

        def validation_step(self, batch, batch_idx):
            x, y = batch
            prediction = self(x)
            self.predictions.append(prediction.detach())
            self.targets.append(y)
            self.error(prediction, y)
            self.log("val_mae", self.error)

    model = Scored()
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, limit_train_batches=2)
    trainer.fit(model, *loaders())
    expected = (torch.cat(model.predictions[-4:]) - torch.cat(model.targets[-4:])).abs().mean()
    assert trainer.callback_metrics["val_mae"].device.type in ("cuda", "cpu")
    torch.testing.assert_close(trainer.callback_metrics["val_mae"].float().cpu(), expected.float().cpu())
