"""A long run with many checkpoint saves holds no more file descriptors or memory at its end than after warming up."""

from __future__ import annotations

import gc
import os
import resource

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from phalanx.callbacks import ModelCheckpoint

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def _fit(root, steps: int, every: int) -> int:
    # Steps cost far more than saves here (each a few times a save's time), so the saves come every second step: the
    # saves, the descriptors they open and the logger's 40 writes are what the run repeats.
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    checkpoints = ModelCheckpoint(
        dirpath=root, every_n_train_steps=every, save_top_k=2, monitor="train_loss", save_last=True
    )
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[checkpoints],
        enable_checkpointing=True,
        default_root_dir=root,
        logger=True,
        log_every_n_steps=10,
    )
    # 330 kB of weights: 200 leaked copies of a checkpoint would be 64 MiB, over the bound below.
    trainer.fit(Regressor(hidden=16384, lr=1e-4), DataLoader(data, batch_size=8, shuffle=True))
    return trainer.global_step


def test_400_steps_with_200_saves_leak_no_descriptors_or_memory(tmp_path):
    assert _fit(tmp_path / "warm-up", steps=40, every=2) == 40  # imports, allocator pools, first-save caches
    gc.collect()
    descriptors, resident = _open_descriptors(), _resident_bytes()
    assert _fit(tmp_path / "long", steps=400, every=2) == 400
    gc.collect()
    saved = sorted(p.name for p in (tmp_path / "long").iterdir() if p.suffix == ".ckpt")
    assert len(saved) == 3 and "last.ckpt" in saved  # top 2 and last: the 200 saves removed what they replaced
    assert _open_descriptors() <= descriptors
    growth = _resident_bytes() - resident
    assert growth < 32 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over 400 steps and 200 saves"
