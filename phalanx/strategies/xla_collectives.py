"""Graph cuts and collectives on XLA devices, safe when several device threads share one process.

torch_xla runs one replica per device; on the PJRT CPU runtime (and TPU v2/v3 hosts) the replicas of a process are
threads. XLA:CPU then aborts a collective after 10 s if the threads compiled or launched it differently. What avoids
that here (ordinary use of torch_xla's public API, see the README's XLA section):

- every graph that holds a collective is cut right away (``torch_xla.sync()``) under one process-wide lock, so the
  threads compile one graph at a time (the second one hits the compile cache and gets the same collective ids), and
  nothing reads a collective's result before its graph ran;
- all-gathers use the native collective (``pin_layout=False``), which builds the same graph on every replica;
- after a cut, a thread waits for its own device with the GIL released, outside the lock.

Object collectives pickle to bytes, gather the lengths, then the bytes padded to a power of two (few compiled shapes).
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
from torch import Tensor

_STEP_LOCK = threading.Lock()
_REDUCE_TYPES = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


def threads_share_process() -> bool:
    """Whether several replicas of this job run as threads of this process."""
    import torch_xla.runtime as xr

    return xr.addressable_device_count() > 1 and xr.world_size() > 1


def cut_graph() -> None:
    """End the pending graph and launch it; threads sharing a process take turns and then wait for their device."""
    import torch_xla

    if not threads_share_process():
        torch_xla.sync()
        return
    import torch_xla.core.xla_model as xm

    with _STEP_LOCK:
        torch_xla.sync()
    xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))


def world_size() -> int:
    """Replicas in the job (1 outside torch_xla's launcher)."""
    import torch_xla.runtime as xr

    return xr.world_size()


def all_reduce(tensor: Tensor, reduce_op: str, device: torch.device) -> Tensor:
    """Reduce ``tensor`` over the replicas with 'sum', 'mean', 'max' or 'min'; the result keeps ``tensor``'s device."""
    import torch_xla.core.xla_model as xm

    original = tensor.device
    value = tensor.to(device)
    if value.dtype == torch.bool:
        value = value.to(torch.int32)
    reduced = xm.all_reduce(_REDUCE_TYPES[reduce_op], value)
    if reduce_op == "mean":
        reduced = reduced / world_size()
    cut_graph()
    return reduced.to(original) if original != device else reduced


def all_gather(tensor: Tensor, device: torch.device) -> Tensor:
    """Stack ``tensor`` from every replica along a new first dimension; the result keeps ``tensor``'s device."""
    import torch_xla.core.xla_model as xm

    original = tensor.device
    gathered = xm.all_gather(tensor.to(device).unsqueeze(0), dim=0, pin_layout=False)
    cut_graph()
    return gathered.to(original) if original != device else gathered


def _padded_length(length: int) -> int:
    # Every distinct length is a new compiled graph: round up to a power of two (at least 256 bytes).
    return max(256, 1 << (length - 1).bit_length())


def all_gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """Every replica's ``payload``, in rank order."""
    lengths = all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device), device).cpu().flatten()
    size = _padded_length(int(lengths.max()))
    buffer = torch.zeros(size, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = all_gather(buffer.to(device), device).cpu()
    return [bytes(gathered[rank, : int(length)].numpy()) for rank, length in enumerate(lengths.tolist())]


def all_gather_object(obj: Any, device: torch.device) -> list[Any]:
    """Every replica's picklable ``obj``, in rank order."""
    return [pickle.loads(data) for data in all_gather_bytes(pickle.dumps(obj), device)]


def barrier(device: torch.device) -> None:
    """Return once every replica got here (a one-element all-reduce, waited for)."""
    all_reduce(torch.zeros(1, device=device), "sum", device).cpu()


class _GatherWithGradients(torch.autograd.Function):
    """``all_gather`` whose backward sends each replica the summed gradient of its own slice."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, device: torch.device) -> Tensor:
        import torch_xla.runtime as xr

        ctx.rank = xr.global_ordinal()
        return all_gather(tensor, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch_xla.core.xla_model as xm

        # Stays in the backward graph; the optimizer step's cut runs it.
        return xm.all_reduce("sum", grad)[ctx.rank], None


def all_gather_with_gradients(tensor: Tensor, device: torch.device) -> Tensor:
    """``all_gather`` through which gradients flow back to every replica's input."""
    return _GatherWithGradients.apply(tensor, device)
