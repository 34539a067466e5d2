"""Each save point dumps (and gathers) once on 2 CPU processes: one job runs FSDP with both state_dict_types and
DeepSpeed ZeRO-2 and ZeRO-3 (directory layouts), results in OUT for tests/distributed/test_save_once.py.

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
from phalanx.strategies import DeepSpeedStrategy, FSDPStrategy

OUT = Path(sys.argv[1])


class RecordingIO(TorchCheckpointIO):
    """Records (per rank) every save, directory start/finish, copy and removal that reaches the CheckpointIO."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.calls.append(["save", os.path.basename(path)])
        super().save_checkpoint(checkpoint, path, storage_options)

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Any, **kwargs: Any) -> None:
        self.calls.append(["save_sharded", os.path.basename(path)])
        super().save_sharded_checkpoint(checkpoint, path, **kwargs)

    def start_directory_checkpoint(self, path: Any, **kwargs: Any) -> str:
        self.calls.append(["start", os.path.basename(path)])
        return super().start_directory_checkpoint(path, **kwargs)

    def finish_directory_checkpoint(self, staging: Any, path: Any, **kwargs: Any) -> None:
        self.calls.append(["finish", os.path.basename(path)])
        super().finish_directory_checkpoint(staging, path, **kwargs)

    def copy_checkpoint(self, source: Any, target: Any) -> None:
        self.calls.append(["copy", os.path.basename(source), os.path.basename(target)])
        super().copy_checkpoint(source, target)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(["remove", os.path.basename(path)])
        super().remove_checkpoint(path)


def counting(base: type) -> type:
    """``base`` whose ``module_state_dict`` (the gather of 'full' FSDP and ZeRO-3) is counted, by global step."""

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.gathers: list[int] = []
            self.step_of: Any = None

        def module_state_dict(self) -> dict[str, Any]:
            self.gathers.append(self.step_of())
            return super().module_state_dict()

    return Counting


STRATEGIES = {
    "full": lambda: counting(FSDPStrategy)(state_dict_type="full"),
    "sharded": lambda: counting(FSDPStrategy)(state_dict_type="sharded"),
    "deepspeed_2": lambda: counting(DeepSpeedStrategy)(stage=2),
    "deepspeed_3": lambda: counting(DeepSpeedStrategy)(stage=3),
}


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


def run(name: str) -> None:
    folder = OUT / name
    io, strategy = RecordingIO(), STRATEGIES[name]()
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
    # The copy is a checkpoint like any other: the same strategy resumes from it.
    resumed = quiet(strategy=STRATEGIES[name](), devices=2, max_steps=8)
    resumed.strategy.step_of = lambda: resumed.global_step
    continued = DumpCounter()
    resumed.fit(continued, loader(2), ckpt_path=str(folder / "last.ckpt"))
    result["resumed"] = [resumed.global_step, len(continued.losses)]
    (OUT / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name in STRATEGIES:
        run(name)
