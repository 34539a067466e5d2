"""One replica group of a semi-synchronous fault-tolerant run (strategy ddp_ft with DiLoCo, the Trainer's defaults).

Usage: python ft_semi_sync_job.py OUT_DIR, with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, MASTER_ADDR
and MASTER_PORT set; with KILL_AT_STEP=N the process kills itself (SIGKILL) right after its optimizer step N. Each
step appends its batch's sample indices to OUT_DIR/group<id>.steps (kept across a kill and restart), and
OUT_DIR/group<id>.json gets the final weights.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from ddp_common import IndexedRegression, write_json
from ft_group_job import CommittedBatches, MomentumNet
from ft_harness import json_lines, log_phalanx_to_stdout
from torch.utils.data import DataLoader

import phalanx
from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance, SemiSync

BATCH = 4  # per replica group
SYNC_EVERY = 3
STEPS = 3 * SYNC_EVERY
SAMPLES = 96  # 12 batches per group for 2 groups: the run stays inside the first epoch
INNER = {"lr": 0.05, "momentum": 0.9}  # MomentumNet's optimizer (SGD)
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}  # the DiLoCo paper's outer optimizer


def outer_optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, **OUTER)


class KillAt(phalanx.Callback):
    """Kills this process with SIGKILL at the end of optimizer step ``step`` (after the batch was recorded)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out = Path(sys.argv[1])
    group = int(os.environ["REPLICA_GROUP_ID"])
    log_phalanx_to_stdout()
    options = dataclasses.replace(
        FaultTolerance.from_environment(),
        semi_sync=SemiSync("diloco", SYNC_EVERY, outer_optimizer),
        quorum_timeout=timedelta(seconds=180),  # the survivor waits for the restart, slow on a loaded machine
    )
    steps = CommittedBatches(out / f"group{group}.steps")
    callbacks: list[Any] = [steps]
    if "KILL_AT_STEP" in os.environ:
        callbacks.append(KillAt(int(os.environ["KILL_AT_STEP"])))
    phalanx.seed_everything(7 + group)  # group 1 starts from other weights and receives group 0's at the first quorum
    model = MomentumNet(lr=INNER["lr"])
    trainer = phalanx.Trainer(
        strategy=DDPFaultTolerantStrategy(fault_tolerance=options),
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        default_root_dir=str(out / f"group{group}"),
        callbacks=callbacks,
    )
    train = DataLoader(IndexedRegression(n=SAMPLES), batch_size=BATCH)
    trainer.fit(model, train, DataLoader(IndexedRegression(n=8, seed=1), batch_size=4))
    write_json(
        out,
        f"group{group}.json",
        {
            "global_step": trainer.global_step,
            "steps": json_lines(steps.path),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        },
    )


if __name__ == "__main__":
    main()
