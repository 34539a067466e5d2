"""The hand-back of a spawned or forked stage to the main process, on two simulated nodes or with its write failing.

Usage: python spawn_hand_back_job.py OUT_DIR STRATEGY MODE
  MODE "node": one node of a two-node run (NODE_RANK, MASTER_ADDR and MASTER_PORT in the environment), one worker per
  node; its main process writes node<N>.json with what it got back.
  MODE "unwritable": one node; the worker can no longer write files once it has trained (RLIMIT_FSIZE), as with a full
  temporary directory: the main process writes error.json with the error it raised.
"""

import os
import resource
import signal
import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ModelCheckpoint


class CannotWriteAfterFit(Net):
    """Takes away every file write of its worker once the fit is done (a file over 512 bytes fails with EFBIG)."""

    def on_fit_end(self) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


if __name__ == "__main__":
    out, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    nodes = 2 if mode == "node" else 1
    trainer = phalanx.Trainer(
        strategy=strategy, num_nodes=nodes, devices=1, accelerator="cpu", max_steps=3, logger=False,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", monitor="train_loss")],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    phalanx.seed_everything(1)
    model = Net() if mode == "node" else CannotWriteAfterFit()
    data = DataLoader(IndexedRegression(n=24), batch_size=4)
    if mode == "node":
        trainer.fit(model, data)
        write_json(
            out,
            f"node{os.environ['NODE_RANK']}.json",
            {
                "global_step": trainer.global_step,
                "best_model_path": trainer.checkpoint_callback.best_model_path,
                "weights": [round(float(value), 6) for value in torch.cat([p.flatten() for p in model.parameters()])],
            },
        )
    else:
        try:
            trainer.fit(model, data)
        except Exception as error:  # noqa: BLE001 (the test checks which one, and what it says)
            write_json(out, "error.json", {"type": type(error).__name__, "message": str(error)})
