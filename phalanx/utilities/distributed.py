"""Thin helpers over torch.distributed: reductions by name, and collectives whose failures say what to do."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import Tensor

_T = TypeVar("_T")
REDUCE_OPS = ("mean", "sum", "max", "min")


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _reduce_op(name: str) -> Any:
    ops = {
        "sum": torch.distributed.ReduceOp.SUM,
        "mean": torch.distributed.ReduceOp.SUM,
        "max": torch.distributed.ReduceOp.MAX,
        "min": torch.distributed.ReduceOp.MIN,
    }
    if name not in ops:
        raise ValueError(f"reduce_op={name!r} is not supported; choose one of {REDUCE_OPS}.")
    return ops[name]


_REDUCE_ALIASES = {"avg": "mean", "average": "mean"}


def normalize_reduce_op(reduce_op: Any) -> str:
    """One of ``REDUCE_OPS`` from what Lightning takes: those names (any case), 'avg', ReduceOp members, None (mean)."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = _REDUCE_ALIASES.get(reduce_op.lower(), reduce_op.lower())
    else:
        # torch.distributed.ReduceOp members (ReduceOp.SUM, ReduceOp.AVG, ...) print as "RedOpType.SUM".
        name = str(getattr(reduce_op, "name", reduce_op)).rsplit(".", 1)[-1].lower()
        name = _REDUCE_ALIASES.get(name, name)
    if name not in REDUCE_OPS:
        raise ValueError(
            f"reduce_op={reduce_op!r} is not supported; choose one of {REDUCE_OPS} (any case), 'avg', or the matching"
            " torch.distributed.ReduceOp member."
        )
    return name


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation, the rank and the remedy."""


def run_collective(name: str, rank: int, timeout: timedelta | None, collective: Callable[[], _T]) -> _T:
    """Run ``collective``; turn a failure into a CollectiveError naming ``name`` and ``rank``."""
    with naming_collective_failures(name, rank, timeout):
        return collective()


@contextmanager
def naming_collective_failures(
    name: str, rank: int, timeout: timedelta | None, *, transport_only: bool = False
) -> Iterator[None]:
    """Turn a timeout or a lost peer inside the block into a CollectiveError naming ``name``, ``rank`` and ``timeout=``.

    Collectives that torch runs on its own (DDP's gradient all-reduce, FSDP's parameter gathers) fail with the
    transport's raw text ("Timed out waiting 10000ms for recv"); wrapping the step that runs them says which one it was.
    A CollectiveError raised inside (a collective phalanx named itself) passes through unchanged. With
    ``transport_only``, only errors whose text comes from torch.distributed's transports are translated, so that a
    user's own "timed out" inside a step keeps its message.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        explained = explain_collective_failure(name, rank, timeout, error)
        if explained is None or (transport_only and not from_transport(error)):
            raise
        raise explained from None


def explain_collective_failure(
    name: str, rank: int, timeout: timedelta | None, error: RuntimeError
) -> CollectiveError | None:
    """A CollectiveError saying what ``error`` means for the collective ``name``; None if not a collective's."""
    text = str(error)
    first_line = text.splitlines()[0] if text else repr(error)
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return CollectiveError(
            f"The collective '{name}' on rank {rank} timed out after {timeout}: another process did not reach the"
            " same call (it may have crashed, or be stuck or much slower). If the wait is legitimate (slow data"
            " loading, a long checkpoint), raise the limit with the strategy's timeout= argument. Original error:"
            f" {first_line}"
        )
    if peer_left(error):
        return CollectiveError(
            f"The collective '{name}' on rank {rank} failed because another process left the job (it crashed or was"
            f" killed). Original error: {first_line}"
        )
    return None


_TRANSPORT_MARKERS = ("gloo", "nccl", "c10d", "processgroup", "timed out waiting", "watchdog")


def from_transport(error: BaseException) -> bool:
    """Whether ``error``'s text comes from a torch.distributed transport (gloo, NCCL, c10d)."""
    text = str(error).lower()
    return any(marker in text for marker in _TRANSPORT_MARKERS)


_PEER_LEFT = ("connection closed", "connection reset", "broken pipe", "another process left the job")


def peer_left(error: BaseException) -> bool:
    """Whether ``error`` only says that another process of the job went away (a consequence, not a cause)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in _PEER_LEFT)


def all_reduce(tensor: Tensor, reduce_op: str, group: Any | None, rank: int, timeout: timedelta | None) -> Tensor:
    """Return the reduction of ``tensor`` over all processes (``mean`` divides the sum by the world size)."""
    reduce_op = normalize_reduce_op(reduce_op)
    op = _reduce_op(reduce_op)
    result = tensor.detach().clone()
    if not result.is_floating_point() and reduce_op == "mean":
        result = result.float()
    run_collective(
        f"all_reduce({reduce_op})", rank, timeout, lambda: torch.distributed.all_reduce(result, op=op, group=group)
    )
    if reduce_op == "mean":
        result = result / torch.distributed.get_world_size(group)
    return result


def all_gather(tensor: Tensor, group: Any | None, sync_grads: bool, rank: int, timeout: timedelta | None) -> Tensor:
    """Stack ``tensor`` from every process along a new first dimension (tensors must have the same shape)."""
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as differentiable_all_gather

        gathered = run_collective(
            "all_gather",
            rank,
            timeout,
            lambda: differentiable_all_gather(tensor, group=group or torch.distributed.group.WORLD),
        )
        return torch.stack(gathered)
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    run_collective("all_gather", rank, timeout, lambda: torch.distributed.all_gather(gathered, tensor, group=group))
    return torch.stack(gathered)
