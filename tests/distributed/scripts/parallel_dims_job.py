"""Hybrid sharding on a 2 x 2 mesh, ModelParallel on 2 x 2, and a pipeline of 2 stages composed with data or tensor
parallelism (pp=2 x dp=2, pp=2 x tp=2), 4 CPU processes (gloo), for tests/distributed/test_parallel_dims_processes.py.
Each composed pipeline saves a sharded checkpoint after its epoch, which the other composed layout then resumes for a
second epoch.

Usage: python parallel_dims_job.py OUT   (phalanx starts the other three processes itself)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from pipeline_common import COMPOSED, QUIET, AdamNet
from pipeline_common import loader as pipeline_loader
from sharded_common import MLP, loader, quiet

import phalanx
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.utilities.dtensor import full_module_state, is_dtensor
from phalanx.utilities.optimizer_names import state_by_name

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


class ComposedNet(AdamNet):
    """``AdamNet`` in two pipeline stages, each stage sharded over the data axis or its blocks split over the tensor
    axis."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.inner = inner
        self.hooks = None  # gradients are DTensors here: test_pipeline_processes.py checks the hooks

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        super().configure_model()  # keeps this rank's stage
        mesh = self.device_mesh
        if self.inner == "tensor":
            plan = {f"{key}.linear": ColwiseParallel(output_layouts=Replicate()) for key in self.blocks._modules}
            parallelize_module(self.blocks, mesh["tensor_parallel"], plan)
        else:
            for block in self.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])


def full_optimizer_state(trainer: phalanx.Trainer, module: ComposedNet) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state of every stage's parameters, whole tensors keyed by parameter name, on every rank."""
    state = state_by_name(trainer.optimizers[0], module)["state"]
    # full_tensor() gathers over the tensor's mesh: the ranks of one stage walk the same names in the same order.
    mine = {
        name: {key: value.full_tensor() if is_dtensor(value) else value for key, value in entries.items()}
        for name, entries in state.items()
    }
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for part in trainer.strategy.all_gather_object(mine):
        whole.update(part)
    return whole


def fit_pipeline(name: str, inner: str, replicas: int, ckpt_path: Path | None = None, **sizes: int) -> dict[str, Any]:
    """Fit ``ComposedNet`` (seeded as one process's ``AdamNet``) in 2 stages x ``sizes`` for one epoch, then save a
    sharded checkpoint; or, from ``ckpt_path``, for a second epoch. The rest as ``fit``."""
    phalanx.seed_everything(1)
    module = ComposedNet(inner)
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, microbatches=2, **sizes)
    epochs = 1 if ckpt_path is None else 2
    options = {**QUIET, **COMPOSED, "max_epochs": epochs}
    trainer = phalanx.Trainer(accelerator="cpu", devices=4, strategy=strategy, **options)
    trainer.fit(module, pipeline_loader(8 // replicas), ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(OUT / f"{name}.ckpt")
    mesh = trainer.strategy.device_mesh
    local = {n: p.to_local().numel() if is_dtensor(p) else p.numel() for n, p in module.named_parameters()}
    weights: dict[str, torch.Tensor] = {}
    for part in trainer.strategy.all_gather_object(full_module_state(module, keep=True)):
        weights.update(part)
    optimizer = full_optimizer_state(trainer, module)
    if trainer.is_global_zero:
        torch.save(weights, OUT / f"{name}.pt")
        torch.save(optimizer, OUT / f"{name}.optimizer.pt")
    return {
        "losses": trainer.strategy.all_gather_object(module.losses),
        "global_step": trainer.global_step,
        "mesh": [list(mesh.mesh_dim_names), list(mesh.shape)],
        "local_numel": trainer.strategy.all_gather_object(local),
        "sampler": trainer.strategy.all_gather_object(trainer.strategy.distributed_sampler_kwargs),
        "stages": trainer.strategy.all_gather_object(list(trainer.strategy.pipeline_stages)),
    }


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
    results["pp_dp"] = fit_pipeline("pp_dp", "data", 2, data_parallel_size=2)
    results["pp_tp"] = fit_pipeline("pp_tp", "tensor", 1, tensor_parallel_size=2)
    # Each composed layout's checkpoint moves to the other: its shards are split another way there.
    results["pp_dp__pp_tp"] = fit_pipeline("pp_dp__pp_tp", "tensor", 1, OUT / "pp_dp.ckpt", tensor_parallel_size=2)
    results["pp_tp__pp_dp"] = fit_pipeline("pp_tp__pp_dp", "data", 2, OUT / "pp_tp.ckpt", data_parallel_size=2)
    if torch.distributed.get_rank() == 0:
        (OUT / "results.json").write_text(json.dumps(results))
