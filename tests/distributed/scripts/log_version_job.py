"""A two-process DDP fit into a logger folder that already holds versions, while another run claims the next one.

Usage: python log_version_job.py OUT_DIR SAVE_DIR. Rank 0 claims its version; then, before rank 1 looks, "another run"
(simulated on rank 0) claims the next free version in the same folder. Each rank writes the log_dir it saw during
set-up and after fit, and the other run's version.
"""

import os
import sys
from pathlib import Path

from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx
from phalanx.loggers import CSVLogger


class Probe(Net):
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer.global_rank == 0:
            claimed = trainer.log_dir  # rank 0's claim (made already when the Trainer agrees on versions)
            # Another run started in the same folder now: it claims the next free version, as any run does.
            self.other_run = CSVLogger(save_dir=sys.argv[2], name="logs").version
            assert os.path.isdir(claimed)
        trainer.strategy.barrier("another run claimed its version")
        self.log_dir_at_setup = trainer.log_dir


def main() -> None:
    out = Path(sys.argv[1])
    model = Probe()
    model.other_run = None
    trainer = phalanx.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=2,
        logger=CSVLogger(save_dir=sys.argv[2], name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=32), batch_size=4))
    record = {"setup": model.log_dir_at_setup, "after_fit": trainer.log_dir, "other_run": model.other_run}
    write_json(out, f"rank{trainer.global_rank}.json", record)


if __name__ == "__main__":
    main()
