"""Time of the first compiled training steps and of later steps on torch_xla's PJRT CPU runtime, 1 and 2 devices.

Run with the XLA virtual environment (see the README): ``.venv-xla/bin/python bench/xla_steps.py``. Each device count
runs in a fresh process (the runtime starts once per process). A step's time runs from the end of the previous step to
the moment its device work finished (the callback waits for the device, which the strategies do not do on one
device), so compilation shows in the first steps. Prints one Markdown table row per device count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402
from phalanx.strategies import XLAFSDPStrategy, XLAStrategy  # noqa: E402


class MLP(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StepTimes(phalanx.Callback):
    """Rank 0 writes the time of every step to ``out`` (waiting for the device at each step's end)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.times: list[float] = []
        self.last = 0.0

    def on_train_start(self, trainer: phalanx.Trainer, module: Any) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, trainer: phalanx.Trainer, *args: Any) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now

    def on_train_end(self, trainer: phalanx.Trainer, module: Any) -> None:
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps(self.times))


def _child(devices: int, steps: int, out: str, strategy_name: str) -> None:
    torch.manual_seed(0)
    # Replicas each read their part of the global batch of 64; SPMD's one process reads all of it.
    per_device = 64 if strategy_name == "xla_spmd" else 64 // devices
    data = TensorDataset(torch.randn(64 * steps, 32), torch.randn(64 * steps, 1))
    strategies = {"xla": XLAStrategy, "xla_fsdp": XLAFSDPStrategy}
    strategy: Any = strategies[strategy_name](start_method="fork") if strategy_name in strategies else strategy_name
    trainer = phalanx.Trainer(
        accelerator="xla",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimes(out)],
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=per_device))


def _run(devices: int, steps: int, strategy: str) -> list[float]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "times.json")
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, __file__, "--child", str(devices), "--steps", str(steps), "--out", out]
        command += ["--strategy", strategy]
        subprocess.run(command, env=env, check=True, timeout=900, capture_output=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.steps, args.out, args.strategy)
        return
    import torch_xla

    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, {os.cpu_count()} CPUs")
    print("| strategy | devices | step 1 (s) | step 2 (s) | step 3 (s) | later, median (ms) | later, min (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for devices, strategy in ((1, "single_xla"), (2, "xla"), (2, "xla_spmd"), (2, "xla_fsdp")):
        times = _run(devices, args.steps, strategy)
        later = times[3:]
        print(
            f"| {strategy} | {devices} | {times[0]:.2f} | {times[1]:.2f} | {times[2]:.3f} |"
            f" {1000 * statistics.median(later):.1f} | {1000 * min(later):.1f} |"
        )


if __name__ == "__main__":
    main()
