"""The baseline of bench_fault_tolerance.py: one rank of a 3-process ``ddp`` job that torchrun restarts whole after a
failure and that resumes with ``ckpt_path="auto"`` (saving every ``SAVE_EVERY`` steps).

Usage: torchrun --nproc-per-node 3 --max-restarts K ddp_job.py OUT_DIR STEPS HIDDEN BATCH SAVE_EVERY, with
tests/ and tests/distributed/scripts on PYTHONPATH. Rank 0 appends a line to OUT_DIR/ddp.jsonl for each step it
finished (its time and process id); each rank writes its process id to OUT_DIR/rank<r>.pid for the bench to kill.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddp_common import IndexedRegression
from ft_chaos_job import SEED, Mlp, samples
from torch.utils.data import DataLoader

import phalanx


class Steps(phalanx.Callback):
    """Rank 0 journals every finished step with its time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            with self.path.open("a") as file:
                file.write(
                    json.dumps({"step": trainer.global_step - 1, "time": time.time(), "pid": os.getpid()}) + "\n"
                )


def main() -> None:
    out, steps, hidden, batch, save_every = Path(sys.argv[1]), *map(int, sys.argv[2:6])
    (out / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    phalanx.seed_everything(SEED)
    saves = phalanx.callbacks.ModelCheckpoint(every_n_train_steps=save_every, save_top_k=1, save_last=True)
    trainer = phalanx.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=3,
        max_steps=steps,
        default_root_dir=str(out / "ddp"),
        callbacks=[Steps(out / "ddp.jsonl"), saves],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
    )
    data = DataLoader(IndexedRegression(n=samples(batch)), batch_size=batch)
    trainer.fit(Mlp(hidden), data, ckpt_path="auto")


if __name__ == "__main__":
    main()
