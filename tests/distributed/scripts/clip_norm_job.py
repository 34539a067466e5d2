"""Clipping by total norm through the Cohort on each CPU strategy, one step of the TransformerBlock on one batch.

Usage: python clip_norm_job.py OUT STRATEGY... ; 'single_device' runs alone in one process (the reference), the others
run one after another in 2 ranks started by the first one's Cohort.launch(). Rank 0 writes OUT/STRATEGY.pt: the
returned norms (2 and inf), the clipped gradients and the weights after one SGD step, all as full tensors.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from sharded_common import TransformerBlock, sequences
from torch import nn

import phalanx
from phalanx.utilities.grad_clipping import clip_grad_norm

MAX_NORM = 0.05  # well under the gradients' norm, so every run clips


class Block(TransformerBlock):
    def configure_model(self) -> None:
        mesh = self.device_mesh  # FSDP's mesh has no tensor-parallel dimension: shard it as FSDP does by default
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
            super().configure_model()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def backward(cohort: phalanx.Cohort, model: Any, optimizer: Any) -> None:
    x, y = sequences()[:8]
    optimizer.zero_grad()
    cohort.backward(nn.functional.mse_loss(model(x), y))


def clipped_step(cohort: phalanx.Cohort) -> dict[str, Any]:
    phalanx.seed_everything(13)
    block = Block()
    model, optimizer = cohort.setup(block, torch.optim.SGD(block.parameters(), lr=0.5))
    backward(cohort, model, optimizer)
    params = [p for p in block.parameters()]
    result: dict[str, Any] = {"mixed": len({type(p.grad) for p in params if p.grad is not None}) > 1}
    result["norm_2"] = float(cohort.clip_gradients(model, optimizer, max_norm=MAX_NORM))
    result["grads"] = {name: full(p.grad) for name, p in block.named_parameters()}
    optimizer.step()
    result["weights"] = {name: full(p) for name, p in block.named_parameters()}
    backward(cohort, model, optimizer)
    result["norm_inf"] = float(full(clip_grad_norm(params, MAX_NORM, math.inf)))
    result["grads_inf"] = {name: full(p.grad) for name, p in block.named_parameters()}
    return result


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    for strategy in strategies:
        devices = 1 if strategy == "single_device" else 2
        cohort = phalanx.Cohort(strategy=strategy, devices=devices, accelerator="cpu")
        cohort.launch()
        result = clipped_step(cohort)
        if cohort.global_rank == 0:
            torch.save(result, out / f"{strategy}.pt")
        cohort.barrier()


if __name__ == "__main__":
    main()
