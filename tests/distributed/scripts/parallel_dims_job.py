"""Hybrid sharding on a 2 x 2 mesh and ModelParallel on 2 x 2, 4 CPU processes (gloo), for
tests/distributed/test_parallel_dims_processes.py.

Usage: python parallel_dims_job.py OUT   (phalanx starts the other three processes itself)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from sharded_common import MLP, loader, quiet

import phalanx
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.utilities.dtensor import full_module_state, is_dtensor

OUT = Path(sys.argv[1])
STEPS = 5


class ParallelMLP(MLP):
    """The MLP with its two blocks split column- then row-wise over the tensor axis, sharded over the data axis."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        plan = {"0.linear": ColwiseParallel(), "1.linear": RowwiseParallel()}
        parallelize_module(self.blocks, mesh["tensor_parallel"], plan)
        fully_shard(self, mesh=mesh["data_parallel"])


def fit(name: str, strategy: Any, module: MLP, replicas: int) -> dict[str, Any]:
    trainer = quiet(strategy=strategy, devices=4, max_steps=STEPS)
    trainer.fit(module, loader(replicas))
    mesh = trainer.strategy.device_mesh
    local = sum(p.to_local().numel() if is_dtensor(p) else p.numel() for p in module.parameters())
    weights = full_module_state(module, keep=True)
    if trainer.is_global_zero:
        torch.save(weights, OUT / f"{name}.pt")
    return {
        "losses": trainer.strategy.all_gather_object(module.losses),
        "mesh": [list(mesh.mesh_dim_names), list(mesh.shape)],
        "local_numel": trainer.strategy.all_gather_object(local),
        "sampler": trainer.strategy.all_gather_object(trainer.strategy.distributed_sampler_kwargs),
    }


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    phalanx.seed_everything(7)
    results = {"hsdp": fit("hsdp", FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)), MLP(), 4)}
    phalanx.seed_everything(7)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    results["model_parallel"] = fit("model_parallel", strategy, ParallelMLP(), 2)
    if torch.distributed.get_rank() == 0:
        (OUT / "results.json").write_text(json.dumps(results))
