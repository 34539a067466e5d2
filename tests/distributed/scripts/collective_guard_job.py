"""A collective Cohort method called on rank 0 only. Usage: python collective_guard_job.py OUT STRATEGY MODE

MODE 'alone': rank 0 calls save, rank 1 goes on with other work (sleeps); 'other': rank 0 calls save, rank 1 barrier.
Each rank writes the error it got as OUT/rank{R}.txt and exits with status 3.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import phalanx


def main() -> None:
    out, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    layer = nn.Linear(2, 2)
    model, optimizer = cohort.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    try:
        if cohort.is_global_zero:
            cohort.save(out / "state.ckpt", {"model": model})
        elif mode == "other":
            cohort.barrier()
        else:
            time.sleep(300)  # the rest of a training loop: no collective Cohort call
    except RuntimeError as error:
        (out / f"rank{cohort.global_rank}.txt").write_text(str(error))
        sys.exit(3)


if __name__ == "__main__":
    main()
