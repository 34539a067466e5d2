"""Saves one checkpoint in one layout; its write stalls (in fsync, before anything is renamed into place) and the
parent kills this process with SIGKILL there, leaving the save's hidden temporaries behind.

Usage: python killed_layout_save_job.py OUT LAYOUT   (prints 'stalled' once the write stalled)
  LAYOUT: one_file | sharded | deepspeed, each optionally prefixed with 'async_' (AsyncCheckpointIO)
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.collectives import Collectives

STALL = threading.Event()
_fsync = os.fsync


def stalling_fsync(fd: int) -> None:
    if STALL.is_set():
        sys.stdout.write("stalled\n")
        sys.stdout.flush()
        time.sleep(600)  # the parent kills the process long before
    _fsync(fd)


def checkpoint() -> dict:
    return {"state_dict": {"w": torch.full((512, 512), 2.0)}, "global_step": 2}  # 1 MiB of weights


def deepspeed_layout(io: object, path: Path) -> None:
    """A DeepSpeed checkpoint directory as DeepSpeedStrategy writes it, through the IO's directory protocol."""
    collectives = Collectives()
    staging = io.start_directory_checkpoint(path, collectives=collectives)
    io.makedirs(os.path.join(staging, "checkpoint"))
    io.save_checkpoint(checkpoint(), os.path.join(staging, "checkpoint", "mp_rank_00_model_states.pt"))
    io.save_checkpoint(checkpoint(), os.path.join(staging, "phalanx_deepspeed_state.pt"))
    io.finish_directory_checkpoint(staging, path, collectives=collectives)


def save(io: object, layout: str, path: Path) -> None:
    if layout == "one_file":
        io.save_checkpoint(checkpoint(), path)
    elif layout == "sharded":
        io.save_sharded_checkpoint(checkpoint(), path, collectives=Collectives())
    else:
        deepspeed_layout(io, path)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out, layout = Path(sys.argv[1]), sys.argv[2]
    io = AsyncCheckpointIO() if layout.startswith("async_") else TorchCheckpointIO()
    os.fsync = stalling_fsync
    STALL.set()
    save(io, layout.removeprefix("async_"), out / "killed.ckpt")
    if isinstance(io, AsyncCheckpointIO):
        io.wait()  # the background write stalls: this waits until the parent kills the process
    sys.stdout.write("not stalled\n")  # the parent fails on this
    sys.exit(3)
