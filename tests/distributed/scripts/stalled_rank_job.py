"""A job in which rank 1 stalls at one point of step 3. Usage: python stalled_rank_job.py STRATEGY POINT TIMEOUT_S
MARKER

STRATEGY: 'ddp' or 'fsdp'. POINT: 'forward' (rank 1 sleeps before its forward pass, so rank 0 waits in the first
collective that step runs: FSDP's parameter all-gather, DDP's gradient all-reduce) or 'backward' (rank 1 sleeps
between its forward and backward passes, so rank 0 waits in the backward pass's collectives). Nothing is logged with
sync_dist, so the only collectives of a step are the ones torch's wrappers run themselves. POINT 'start': rank 1
starts 8 s late (longer than TIMEOUT_S), which must not fail the job: joining is not bounded by the collective timeout.
"""

import os
import sys
import time
from datetime import timedelta

import torch
from ddp_common import IndexedRegression
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.strategies import DDPStrategy, FSDPStrategy


class Stalling(phalanx.TrainingModule):
    def __init__(self, point: str) -> None:
        super().__init__()
        self.point = point
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def _stall_here(self, point: str) -> None:
        if self.point == point and self.global_step == 3 and self.global_rank == 1:
            time.sleep(30)

    def training_step(self, batch, batch_idx):
        self._stall_here("forward")
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_backward(self, loss):
        self._stall_here("backward")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    name, point, timeout = sys.argv[1], sys.argv[2], timedelta(seconds=float(sys.argv[3]))
    if point == "start" and os.environ.get("LOCAL_RANK") == "1":
        time.sleep(8)
    strategy = DDPStrategy(timeout=timeout) if name == "ddp" else FSDPStrategy(timeout=timeout)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Stalling(point), DataLoader(IndexedRegression(n=64), batch_size=4))
