"""Each save point dumps (and gathers) once under FSDP on 2 CPU processes: one job, both state_dict_types, results
in OUT for tests/distributed/test_save_once.py.

Usage: python save_once_job.py OUT   (phalanx starts the second process itself)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from sharded_common import MLP, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io import TorchCheckpointIO
from phalanx.strategies import FSDPStrategy

OUT = Path(sys.argv[1])


class RecordingIO(TorchCheckpointIO):
    """Records (per rank) every save and copy that reaches the CheckpointIO."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.calls.append(["save", os.path.basename(path)])
        super().save_checkpoint(checkpoint, path, storage_options)

    def copy_checkpoint(self, source: Any, target: Any) -> None:
        self.calls.append(["copy", os.path.basename(source), os.path.basename(target)])
        super().copy_checkpoint(source, target)


class CountingFSDP(FSDPStrategy):
    """Counts the module state gathers ('full') or collections ('sharded'), by global step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gathers: list[int] = []
        self.step_of: Any = None

    def module_state_dict(self) -> dict[str, Any]:
        self.gathers.append(self.step_of())
        return super().module_state_dict()


class DumpCounter(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.dumps: list[int] = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.dumps.append(checkpoint["global_step"])


def same(first: Path, second: Path) -> bool:
    a, b = TorchCheckpointIO().load_checkpoint(first), TorchCheckpointIO().load_checkpoint(second)
    return (
        a["global_step"] == b["global_step"]
        and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
        and a["state_dict"].keys() == b["state_dict"].keys()
    )


def run(state_dict_type: str) -> None:
    folder = OUT / state_dict_type
    io, strategy = RecordingIO(), CountingFSDP(state_dict_type=state_dict_type)
    callback = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1, save_last=True)
    phalanx.seed_everything(7)
    module = DumpCounter()
    trainer = quiet(
        strategy=strategy, devices=2, max_steps=6, callbacks=[callback], enable_checkpointing=True, plugins=[io]
    )
    strategy.step_of = lambda: trainer.global_step
    trainer.fit(module, loader(2))
    result = {
        "dumps": module.dumps,
        "gathers": strategy.gathers,
        "io": io.calls,
        "files": sorted(os.listdir(folder)),
        "last_equals_top_k": same(folder / "last.ckpt", Path(callback.best_model_path)),
        "global_step": trainer.global_step,
    }
    (OUT / f"{state_dict_type}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for kind in ("full", "sharded"):
        run(kind)
