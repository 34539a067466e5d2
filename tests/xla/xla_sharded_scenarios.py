"""xla_fsdp's sharded checkpoints on torch_xla's PJRT CPU runtime (run like xla_scenarios.py: ``python THIS NAME``).

Every XLA fit comes first (a forked launch after a CPU backward pass fails), then the CPU runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # tests/xla, tests

import torch  # noqa: E402
from phalanx_testing import loaders  # noqa: E402
from xla_scenarios import AdamRegressor, cpu_weights, max_difference, trainer  # noqa: E402

import phalanx  # noqa: E402
from phalanx.callbacks import ModelCheckpoint  # noqa: E402


def sharded_fit(
    epochs: int, devices: int = 2, batch: int = 8, ckpt_path: str | None = None, **options: Any
) -> AdamRegressor:
    torch.manual_seed(1234)
    model = AdamRegressor(hidden=64)
    strategy = phalanx.strategies.XLAFSDPStrategy(
        start_method=os.environ.get("XLA_START_METHOD", "fork"), state_dict_type="sharded"
    )
    fitted = trainer(accelerator="xla", devices=devices, strategy=strategy, max_epochs=epochs, **options)
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=batch, shuffle=False)
    fitted.fit(model, train, val, ckpt_path=ckpt_path)
    return model


def sharded() -> dict[str, Any]:
    result: dict[str, Any] = {}
    first = sharded_fit(1, callbacks=[ModelCheckpoint(dirpath="sharded_ckpt", save_last=True)])
    torch.save(cpu_weights(first), "after_one_epoch.pt")
    uninterrupted = sharded_fit(2)
    resumed = sharded_fit(2, ckpt_path="sharded_ckpt/last.ckpt")  # as many replicas: each reads its own pieces
    result["resume_diff"] = max_difference(cpu_weights(resumed), cpu_weights(uninterrupted))
    torch.save(cpu_weights(uninterrupted), "uninterrupted.pt")
    # Plain CPU PyTorch, one process, resumes from the same directory.
    torch.manual_seed(1234)
    on_cpu = AdamRegressor(hidden=64)
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=16, shuffle=False)
    cpu_trainer = trainer(accelerator="cpu", max_epochs=2)
    cpu_trainer.fit(on_cpu, train, val, ckpt_path="sharded_ckpt/last.ckpt")
    result["cpu_diff"] = max_difference(cpu_weights(on_cpu), cpu_weights(uninterrupted))
    result["cpu_global_step"] = cpu_trainer.global_step
    result["checkpoint"] = str(Path("sharded_ckpt/last.ckpt").resolve())
    return result


def sharded_on_one_device() -> dict[str, Any]:
    # One replica reads a checkpoint two wrote (whole tensors, cut again), with the same global batch.
    source = Path(os.environ["SHARDED_SOURCE"])
    alone = sharded_fit(2, devices=1, batch=16, ckpt_path=str(source / "sharded_ckpt" / "last.ckpt"))
    uninterrupted = torch.load(source / "uninterrupted.pt", weights_only=True)
    return {"one_device_diff": max_difference(cpu_weights(alone), uninterrupted)}


SCENARIOS = {"sharded": sharded, "sharded_on_one_device": sharded_on_one_device}


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    outcome = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(outcome), flush=True)
