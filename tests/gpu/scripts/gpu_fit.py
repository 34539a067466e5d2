"""One small fit with a named strategy and precision; rank 0 writes what the test checks to OUT.json.

Usage: python gpu_fit.py OUT.json STRATEGY DEVICES PRECISION [ACCELERATOR]   (run by tests/gpu/test_cuda_strategies.py;
ACCELERATOR defaults to cuda, and cpu runs the same job on gloo to check the script without a GPU)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


class Net(phalanx.TrainingModule):
    """Two hidden layers and Adam; rank 0 writes its first and last losses, device and backend at the end of fit."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layers = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh.mesh_dim_names != ("data_parallel", "tensor_parallel"):
            return  # only model_parallel leaves the parallelisation to the module
        from torch.distributed.fsdp import fully_shard

        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.layers, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-4)  # eps=1e-8 is 0 in float16 (16-true)

    def on_train_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        result = {
            "first": self.losses[0],
            "last": self.losses[-1],
            "steps": len(self.losses),
            "param_device": next(self.layers.parameters()).device.type,
            "backend": torch.distributed.get_backend() if distributed else None,
            "world_size": torch.distributed.get_world_size() if distributed else 1,
        }
        with open(self.out, "w") as handle:
            json.dump(result, handle)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :1] * x[:, 1:2] + x[:, 2:3]), batch_size=32)


if __name__ == "__main__":
    out, strategy, devices, precision = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    accelerator = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    phalanx.seed_everything(0)
    trainer = phalanx.Trainer(
        accelerator=accelerator,
        strategy="auto" if strategy == "single_device" else strategy,
        devices=devices,
        precision=precision,
        max_steps=15,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(out), data())
