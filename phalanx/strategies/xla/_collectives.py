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
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

_STEP_LOCK = threading.Lock()
#: Replica threads of this process meet here before each cut (see ``start_replica_threads``); None outside them.
_REPLICA_THREADS: threading.Barrier | None = None
_BARRIER_LOCK = threading.Lock()
_REDUCE_TYPES = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


def threads_share_process() -> bool:
    """Whether several replicas of this job run as threads of this process."""
    import torch_xla.runtime as xr

    return xr.addressable_device_count() > 1 and xr.world_size() > 1


class PeerReplicaFailed(RuntimeError):
    """This replica stopped because another replica thread of its process failed first."""


def join_replica_threads(parties: int, timeout: float) -> threading.Barrier:
    """The barrier the ``parties`` replica threads of this process meet at before each cut (made by the first)."""
    global _REPLICA_THREADS
    with _BARRIER_LOCK:
        if _REPLICA_THREADS is None or _REPLICA_THREADS.broken:
            _REPLICA_THREADS = threading.Barrier(parties, timeout=timeout)
        return _REPLICA_THREADS


def cut_graph(*, keep_generator: bool = False) -> None:
    """End the pending graph and launch it; threads sharing a process meet, take turns, then wait for their device.

    XLA:CPU gives up on a collective after 10 s if a replica has not launched its part by then, and a replica can lag
    that much behind (rank 0 writing a checkpoint, a loaded machine): the replica threads first meet at a barrier
    without such a limit, so they launch each graph together. Every cut moves XLA's random generator on;
    ``keep_generator`` puts it back, for the cuts phalanx adds outside the training step's own (collectives,
    checkpoints): dropout then draws the same whether or not a run logs with sync_dist or saves checkpoints, and a run
    resumed from a checkpoint's generator state draws what the uninterrupted run draws.
    """
    import torch_xla.core.xla_model as xm

    state = xm.get_rng_state() if keep_generator else None
    try:
        _cut_graph()
    finally:
        if state is not None:
            xm.set_rng_state(state)


def _cut_graph() -> None:
    import torch_xla

    if not threads_share_process():
        torch_xla.sync()
        return
    import torch_xla.core.xla_model as xm

    replicas = _REPLICA_THREADS
    if replicas is not None:
        try:
            replicas.wait()
        except threading.BrokenBarrierError:
            raise PeerReplicaFailed(
                "Another replica of this job failed or timed out, so this one stops too (its error is printed above)."
            ) from None
    with _STEP_LOCK:
        torch_xla.sync()
    xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))


def launch_turn() -> AbstractContextManager:
    """Held while this replica thread launches a graph outside a cut (a host read): one thread at a time."""
    return _STEP_LOCK if threads_share_process() else nullcontext()


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
    cut_graph(keep_generator=True)
    return reduced.to(original) if original != device else reduced


def all_gather(tensor: Tensor, device: torch.device) -> Tensor:
    """Stack ``tensor`` from every replica along a new first dimension; the result keeps ``tensor``'s device."""
    import torch_xla.core.xla_model as xm

    original = tensor.device
    gathered = xm.all_gather(tensor.to(device).unsqueeze(0), dim=0, pin_layout=False)
    cut_graph(keep_generator=True)
    return gathered.to(original) if original != device else gathered


def average_gradients(optimizer: Any) -> None:
    """Replace each gradient of ``optimizer``'s parameters by its mean over the replicas (inside the pending graph)."""
    import torch_xla.core.xla_model as xm

    scale = 1.0 / world_size()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                # Out of place, then assigned: torch_xla's in-place list all-reduce (xm.reduce_gradients) was seen to
                # leave accumulated gradients unreduced where hooks read them.
                parameter.grad = xm.all_reduce(xm.REDUCE_SUM, parameter.grad, scale=scale)


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
