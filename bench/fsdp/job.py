"""One FSDP job on 2 CPU processes for bench/bench_fsdp_memory.py: per-rank bytes under each sharding strategy.

Usage: python bench/fsdp/job.py OUT.json   (phalanx starts the second process itself)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import FSDPStrategy
from phalanx.utilities.dtensor import is_dtensor

WIDTH, DEPTH = 1024, 4


class Model(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Probe(phalanx.Callback):
    """Bytes this rank holds: parameters (peak between forward and backward), gradients, Adam state (before a step)."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.figures["shards"] = float(sum(p.to_local().nbytes for p in module.parameters() if is_dtensor(p)))

    def on_before_backward(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
        gathered = float(sum(p.nbytes for p in module.parameters() if not is_dtensor(p)))
        self.figures["parameters"] = max(self.figures.get("parameters", 0.0), self.figures["shards"] + gathered)

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.figures["gradients"] = float(
            sum(p.grad.to_local().nbytes for p in module.parameters() if p.grad is not None)
        )
        states = [v for entries in optimizer.state.values() for v in entries.values() if is_dtensor(v)]
        self.figures["optimizer"] = float(sum(v.to_local().nbytes for v in states))


if __name__ == "__main__":
    figures: dict[str, Any] = {"total_parameter_bytes": float(sum(p.nbytes for p in Model().parameters()))}
    data = DataLoader(TensorDataset(torch.randn(64, WIDTH)), batch_size=8)
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        phalanx.seed_everything(0)
        probe = Probe()
        trainer = phalanx.Trainer(
            strategy=FSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={nn.Linear}),
            accelerator="cpu",
            devices=2,
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[probe],
        )
        trainer.fit(Model(), data)
        figures[sharding] = trainer.strategy.all_gather_object(probe.figures)
    if trainer.is_global_zero:
        with open(sys.argv[1], "w") as handle:
            json.dump(figures, handle)
