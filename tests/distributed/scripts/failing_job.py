"""A DDP job in which one rank fails. Usage: python failing_job.py STRATEGY FAILING_RANK MODE TIMEOUT_S [MARKER]

MODE: 'raise' (an exception in training_step), 'kill' (the process kills itself with SIGKILL), 'hang' (the rank
sleeps past the collective timeout before the next step).
"""

import os
import signal
import sys
import time
from datetime import timedelta

from ddp_common import IndexedRegression, Net
from torch.utils.data import DataLoader

import phalanx
from phalanx.strategies import DDPStrategy


class Failing(Net):
    def __init__(self, failing_rank: int, mode: str) -> None:
        super().__init__()
        self.failing_rank, self.mode = failing_rank, mode

    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and self.global_rank == self.failing_rank:
            if self.mode == "raise":
                raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
            if self.mode == "kill":
                if os.environ.get("KILL_STAMP"):  # when the rank died, for the test that times the job's end
                    with open(os.environ["KILL_STAMP"], "w") as stamp:
                        stamp.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang":
                time.sleep(30)
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    strategy_name, failing_rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    start_method = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}[strategy_name]
    strategy = DDPStrategy(start_method=start_method, timeout=timedelta(seconds=float(sys.argv[4])))
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Failing(failing_rank, mode), DataLoader(IndexedRegression(n=64), batch_size=4))
