"""Clipping by total norm over gradients that are DTensors (tensor parallelism, FSDP2), plain tensors, or a mix."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def _is_dtensor(tensor: Tensor) -> bool:
    # Without the module loaded no DTensor can exist; checking first keeps torch.distributed.tensor off plain runs.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _local_power(tensors: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """Sum of |x|^p over ``tensors`` (max |x| for p = inf) as a 0-d float tensor on ``device``; 0 when empty."""
    parts = [torch.linalg.vector_norm(t.detach(), norm_type).float().to(device) for t in tensors if t.numel()]
    if not parts:
        return torch.zeros((), device=device)
    stacked = torch.stack(parts)
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _sharded_dims(grad: Any) -> tuple[int, ...]:
    """Mesh dimensions a DTensor gradient is split over (a Partial one is made whole first, by the caller)."""
    return tuple(dim for dim, placement in enumerate(grad.placements) if placement.is_shard())


def _whole(grad: Any) -> Any:
    """``grad`` itself, or, when pending a reduction (Partial), the same gradient reduced into its placements."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


def total_grad_norm(grads: list[Tensor], norm_type: float) -> Tensor:
    """The norm of all ``grads`` taken as one vector, equal on every rank to the norm one process would compute.

    A sharded DTensor adds its local shard's |x|^p, summed over the mesh dimensions it is split on (one scalar
    all-reduce per group of gradients sharded alike, not per tensor); a replicated DTensor or a plain tensor, the same
    on every rank, counts once.
    """
    device = grads[0].device
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, list[Tensor]]] = {}
    once: list[Tensor] = []
    for grad in grads:
        if not _is_dtensor(grad):
            once.append(grad)
            continue
        dims = _sharded_dims(grad)
        local = grad.to_local()
        if not dims:
            once.append(local)
            continue
        groups.setdefault((id(grad.device_mesh), dims), (grad.device_mesh, []))[1].append(local)
    reduce_op = torch.distributed.ReduceOp.MAX if math.isinf(norm_type) else torch.distributed.ReduceOp.SUM
    powers = [_local_power(once, norm_type, device)]
    for (_, dims), (mesh, locals_) in sorted(groups.items(), key=lambda item: item[0][1]):
        power = _local_power(locals_, norm_type, mesh.device_type)
        for dim in dims:
            torch.distributed.all_reduce(power, op=reduce_op, group=mesh.get_group(dim))
        powers.append(power.to(device))
    stacked = torch.stack(powers)
    return stacked.max() if math.isinf(norm_type) else stacked.sum().pow(1.0 / norm_type)


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip the gradients of ``parameters`` to total norm ``max_norm`` and return that total norm.

    torch's ``clip_grad_norm_`` refuses a set that mixes DTensor and plain gradients (a tensor-parallel plan that
    leaves embeddings and norms plain) and fails on an empty local shard with ``norm_type=inf``; gradients with any
    DTensor go through ``total_grad_norm`` instead, the others through torch.
    """
    parameters = [p for p in parameters if p.grad is not None]
    if not any(_is_dtensor(p.grad) for p in parameters):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    for p in parameters:
        if _is_dtensor(p.grad):
            p.grad = _whole(p.grad)
    total = total_grad_norm([p.grad for p in parameters], float(norm_type))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in parameters:
        grad = p.grad.to_local() if _is_dtensor(p.grad) else p.grad
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total
