"""One timed training job for bench/bench_preemption.py. Usage: python job.py DEVICES STEPS MODE

MODE: 'off' (no preemption handling) or 'kN' (handling on, ranks agree every N steps). Rank 0 prints the
microseconds per step of the training loop alone (start-up excluded).
"""

import sys
import time

import torch

torch.set_num_threads(1)

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402
from phalanx.trainer import Preemption  # noqa: E402


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LoopTimer(phalanx.Callback):
    def on_train_start(self, trainer, module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero:
            print(f"us_per_step={(time.perf_counter() - self.start) / trainer.global_step * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    devices, steps, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    preemption = False if mode == "off" else Preemption(check_every_n_steps=int(mode[1:]))
    phalanx.seed_everything(0)
    n = devices * 64 * steps
    dataset = TensorDataset(torch.randn(n, 32), torch.randn(n, 1))
    trainer = phalanx.Trainer(
        strategy="ddp" if devices > 1 else "auto",
        devices=devices,
        accelerator="cpu",
        max_steps=steps,
        preemption=preemption,
        callbacks=[LoopTimer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(dataset, batch_size=64, shuffle=True))
