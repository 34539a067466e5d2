"""xla_fsdp's sharded checkpoints and activation checkpointing on torch_xla's PJRT CPU runtime (run like
xla_scenarios.py: ``python THIS NAME``).

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
from torch import nn  # noqa: E402
from xla_scenarios import AdamRegressor, cpu_fit, cpu_weights, max_difference, trainer  # noqa: E402

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


class CountingLinear(nn.Linear):
    """A Linear that counts how often its forward runs (a recomputation in the backward pass runs it again)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class DeeperRegressor(AdamRegressor):
    def __init__(self) -> None:
        super().__init__(hidden=64)
        self.net = nn.Sequential(
            CountingLinear(4, 64), nn.Tanh(), CountingLinear(64, 64), nn.Tanh(), CountingLinear(64, 1)
        )


class CallCounts(phalanx.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        calls = [layer.calls for layer in module.modules() if isinstance(layer, CountingLinear)]
        Path(f"calls_rank{trainer.global_rank}.json").write_text(json.dumps([trainer.global_step, calls]))


def checkpointed_activations() -> dict[str, Any]:
    devices = int(os.environ["CPU_NUM_DEVICES"])
    torch.manual_seed(1234)
    model = DeeperRegressor()
    strategy = phalanx.strategies.XLAFSDPStrategy(
        start_method=os.environ.get("XLA_START_METHOD", "fork"), activation_checkpointing_policy={CountingLinear}
    )
    fitted = trainer(accelerator="xla", devices=devices, strategy=strategy, max_epochs=2, limit_val_batches=0)
    fitted.callbacks.append(CallCounts())
    torch.manual_seed(7)
    train, _ = loaders(n=64, batch_size=16 // devices, shuffle=False)
    try:
        fitted.fit(model, train)
    except Exception as error:  # noqa: BLE001 - the test checks the refusal's message
        return {"refused": f"{type(error).__name__}: {error}"}
    result: dict[str, Any] = {"calls": json.loads(Path("calls_rank0.json").read_text())}
    result["restored_forwards"] = not any("_xla_checkpointed_forward_original" in m.__dict__ for m in model.modules())
    torch.manual_seed(1234)
    reference = DeeperRegressor()
    cpu_fit(reference, 16, max_epochs=2, limit_val_batches=0)
    result["param_diff"] = max_difference(cpu_weights(model), cpu_weights(reference))
    result["cpu_calls"] = [layer.calls for layer in reference.modules() if isinstance(layer, CountingLinear)]
    return result


SCENARIOS = {
    "sharded": sharded,
    "sharded_on_one_device": sharded_on_one_device,
    "checkpointed_activations": checkpointed_activations,
}


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    outcome = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(outcome), flush=True)
