"""Saves a one-file and a sharded checkpoint twice through AsyncCheckpointIO; the second writes stall (in fsync,
before anything is renamed into place) and the parent kills this process with SIGKILL there.

Usage: python async_crash_job.py OUT   (prints 'stalled <thread>' per stalled write, then 'second-returned')
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from phalanx.plugins.io import AsyncCheckpointIO
from phalanx.plugins.io.collectives import Collectives

OUT = Path(sys.argv[1])
STALL = threading.Event()
_PRINT = threading.Lock()
_fsync = os.fsync


def stalling_fsync(fd: int) -> None:
    if STALL.is_set() and threading.current_thread() is not threading.main_thread():
        say(f"stalled {threading.current_thread().name}")
        time.sleep(600)  # the parent kills the process long before
    _fsync(fd)


def say(line: str) -> None:
    with _PRINT:  # one line at a time, from whichever thread
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256, 256), value)}, "global_step": int(value)}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    os.fsync = stalling_fsync
    one_file, sharded = AsyncCheckpointIO(), AsyncCheckpointIO()
    for value in (1.0, 2.0):
        if value == 2.0:
            STALL.set()
        one_file.save_checkpoint(checkpoint(value), OUT / "file.ckpt")
        sharded.save_sharded_checkpoint(checkpoint(value), OUT / "sharded.ckpt", collectives=Collectives())
        if value == 1.0:
            one_file.wait()
            sharded.wait()
    say("second-returned")
    time.sleep(600)
