"""Every strategy's checkpoint save, load and removal reach the CheckpointIO, on 2 CPU processes; one job, results
in OUT for tests/distributed/test_checkpoint_io_strategies.py. Also: FSDP sharded at a file:// URL, DeepSpeed ZeRO-2
checkpoints resumed (converted) on ZeRO-3 and on ddp, and an asynchronous FSDP sharded save that returns while its
(slowed) write is pending.

Usage: python checkpoint_io_job.py OUT   (phalanx starts the second process itself)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from sharded_common import MLP, TransformerBlock, loader, quiet, sequences
from torch.utils.data import DataLoader

import phalanx
import phalanx.plugins.io.sharded_io as sharded_io
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path()


class DirectoryRecordingIO(TorchCheckpointIO):
    """Records (per rank) every call of the protocol but the sharded save, with the base name of its path. (An IO that
    overrides ``save_sharded_checkpoint`` makes AsyncCheckpointIO save sharded checkpoints through it synchronously.)"""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def _record(self, what: str, path: Any) -> None:
        self.calls.append([what, os.path.basename(str(path).rstrip("/"))])

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._record("save", path)
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None) -> dict[str, Any]:
        self._record("load", path)
        return super().load_checkpoint(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        self._record("remove", path)
        super().remove_checkpoint(path)

    def load_sharded_checkpoint(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        self._record("load_sharded", path)
        return super().load_sharded_checkpoint(path, **kwargs)

    def start_directory_checkpoint(self, path: Any, **kwargs: Any) -> str:
        self._record("start", path)
        return super().start_directory_checkpoint(path, **kwargs)

    def finish_directory_checkpoint(self, staging: Any, path: Any, **kwargs: Any) -> None:
        self._record("finish", path)
        super().finish_directory_checkpoint(staging, path, **kwargs)


class RecordingIO(DirectoryRecordingIO):
    """Records every call of the protocol, the sharded save too."""

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Any, **kwargs: Any) -> None:
        self._record("save_sharded", path)
        super().save_sharded_checkpoint(checkpoint, path, **kwargs)


STRATEGIES = {
    "ddp": lambda: DDPStrategy(),
    "fsdp_full": lambda: FSDPStrategy(state_dict_type="full"),
    "fsdp_sharded": lambda: FSDPStrategy(state_dict_type="sharded"),
    "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
    "deepspeed_1": lambda: DeepSpeedStrategy(stage=1),
    "deepspeed_2": lambda: DeepSpeedStrategy(stage=2),
    "deepspeed_3": lambda: DeepSpeedStrategy(stage=3),
}


def model_and_data(name: str) -> tuple[Any, Any]:
    if name == "model_parallel":
        return TransformerBlock(), DataLoader(sequences(), batch_size=8)
    return MLP(), loader(2)


def record(name: str, path: str, asynchronous: bool = False, resume_as: str | None = None) -> dict[str, Any]:
    """Fit 2 steps and save; resume from it for 1 more step (on ``resume_as``, default the same strategy); remove it.
    Every step with a recording IO (wrapped in AsyncCheckpointIO when ``asynchronous``)."""
    phalanx.seed_everything(7)
    recorder = DirectoryRecordingIO() if asynchronous else RecordingIO()
    io = AsyncCheckpointIO(recorder) if asynchronous else recorder
    module, data = model_and_data(name)
    trainer = quiet(strategy=STRATEGIES[name](), devices=2, max_steps=2, plugins=[io])
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    if asynchronous:
        io.wait()  # published in the background: wait for it before looking
    layout = checkpoint_layout(path)
    module, data = model_and_data(resume_as or name)
    resumed = quiet(strategy=STRATEGIES[resume_as or name](), devices=2, max_steps=3, plugins=[io])
    resumed.fit(module, data, ckpt_path=path)
    resumed.strategy.remove_checkpoint(path)
    resumed.strategy.barrier("removed")
    try:
        checkpoint_layout(path)
        removed = False
    except FileNotFoundError:
        removed = True
    return {
        "io": recorder.calls,
        "layout": layout,
        "resumed_step": resumed.global_step,
        "removed": removed,
        "rank": resumed.global_rank,
    }


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from phalanx.utilities.dtensor import is_dtensor

    return {k: (v.full_tensor() if is_dtensor(v) else v).detach().clone() for k, v in module.state_dict().items()}


def asynchronous(path: str) -> dict[str, Any]:
    """An FSDP sharded save through AsyncCheckpointIO, made during fit (at its end), returns while its write (slowed)
    is pending; then it loads. (A save after fit is finished before it returns: no teardown would report its error.)"""
    release = threading.Event()
    original = sharded_io.storage_writer
    seen: dict[str, Any] = {}

    def slowed(staging: Any, storage_options: Any | None = None) -> Any:
        writer = original(staging, storage_options)
        write_data = writer.write_data
        writer.write_data = lambda plan, planner: (release.wait(60), write_data(plan, planner))[1]
        return writer

    class SaveAtTheEnd(phalanx.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            seen["expected"] = whole(trainer.strategy.module)
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            seen["returned_after"] = time.perf_counter() - start
            seen["pending"] = not os.path.exists(path) and not release.is_set()
            release.set()

    sharded_io.storage_writer = slowed
    phalanx.seed_everything(7)
    io = AsyncCheckpointIO(DirectoryRecordingIO())
    module = MLP()
    trainer = quiet(
        strategy=FSDPStrategy(state_dict_type="sharded"),
        devices=2,
        max_steps=2,
        plugins=[io],
        callbacks=[SaveAtTheEnd()],
    )
    trainer.fit(module, loader(2))  # its teardown waits for the write
    sharded_io.storage_writer = original
    expected = seen["expected"]
    loaded = TorchCheckpointIO().load_checkpoint(path)["state_dict"]
    equal = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    return {
        "pending_at_return": seen["pending"],
        "returned_after": seen["returned_after"],
        "loads_equal": equal,
        "inner_io": io.checkpoint_io.calls,
    }


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in STRATEGIES:
        results[name] = record(name, str(OUT / f"{name}.ckpt"))
    results["fsdp_sharded_url"] = record("fsdp_sharded", f"file://{OUT / 'url.ckpt'}")
    results["deepspeed_2_url"] = record("deepspeed_2", f"file://{OUT / 'ds_url.ckpt'}")
    results["fsdp_sharded_async"] = record("fsdp_sharded", str(OUT / "fsdp_sharded_async.ckpt"), asynchronous=True)
    # Resumes that convert: DeepSpeed's files read whole, each one through the IO (stage 3), or as one directory (ddp).
    results["deepspeed_2_as_3"] = record("deepspeed_2", str(OUT / "ds2_as_3.ckpt"), resume_as="deepspeed_3")
    results["deepspeed_2_as_ddp"] = record("deepspeed_2", str(OUT / "ds2_as_ddp.ckpt"), resume_as="ddp")
    results["deepspeed_2_async"] = record("deepspeed_2", str(OUT / "deepspeed_2_async.ckpt"), asynchronous=True)
    results["async"] = asynchronous(str(OUT / "async.ckpt"))
    (OUT / f"rank{results['ddp']['rank']}.json").write_text(json.dumps(results))
