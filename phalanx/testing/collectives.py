"""Checks of a set-up strategy's collectives: each compares what every rank gets with what the arithmetic says.

Every check runs all of its collectives first and judges afterwards, so that a wrong answer on one rank never leaves
another rank waiting in a collective it skipped. Each raises AssertionError naming the call, the rank, what came back
and what was expected; call them on every rank, in the same order.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from phalanx.strategies.strategy import Strategy
from phalanx.testing.report import NotApplicable

#: How long the last rank sleeps before the barrier, and how long the others must have waited for it to count.
BARRIER_SLEEP_S = 1.0
BARRIER_MIN_WAIT_S = 0.5


def _ranks(strategy: Strategy, rank: int | None, world_size: int | None) -> tuple[int, int]:
    return (strategy.global_rank if rank is None else rank), (strategy.world_size if world_size is None else world_size)


def _attempt(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    # A collective that raises is a finding, not a reason to skip the collectives that follow it (peers run them).
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001 - reported as the check's failure
        return None, error


def _raised(call: str, error: BaseException) -> str:
    return f"{call} raised {type(error).__name__}: {error}"


def _fail(problems: list[str]) -> None:
    if problems:
        raise AssertionError("\n".join(problems))


def check_reduce(strategy: Strategy, *, rank: int | None = None, world_size: int | None = None) -> None:
    """``reduce`` of rank-dependent tensors gives their mean (the default), sum, max and min; unknown ops raise."""
    rank, world = _ranks(strategy, rank, world_size)
    # Rank r holds [r + 1, -2 (r + 1)]: every op gives a different answer, and a sum differs from a mean when world > 1.
    columns = torch.tensor([[r + 1.0, -2.0 * (r + 1)] for r in range(world)])
    expected = {
        "mean": columns.mean(0),
        "sum": columns.sum(0),
        "max": columns.max(0).values,
        "min": columns.min(0).values,
    }
    local = columns[rank] if rank < world else torch.zeros(2)
    calls: list[tuple[str, str, Callable[[], Any]]] = [
        ("mean", "reduce(tensor)", lambda: strategy.reduce(local.clone()))
    ]
    for op in ("mean", "sum", "max", "min"):
        calls.append(
            (op, f"reduce(tensor, reduce_op={op!r})", lambda op=op: strategy.reduce(local.clone(), reduce_op=op)),  # type: ignore[misc]  # a default argument binds the loop variable; mypy cannot type such a lambda
        )
    outcomes = [(op, call, *_attempt(run)) for op, call, run in calls]
    _, unknown_error = _attempt(lambda: strategy.reduce(local.clone(), reduce_op="median"))
    problems = []
    for op, call, result, error in outcomes:
        if error is not None:
            problems.append(_raised(call, error))
        elif not isinstance(result, torch.Tensor) or result.shape != expected[op].shape:
            problems.append(
                f"{call} on rank {rank} returned {result!r}; expected a tensor of shape {tuple(expected[op].shape)}."
            )
        elif not torch.allclose(result.detach().float().cpu(), expected[op], rtol=1e-6, atol=1e-6):
            problems.append(
                f"{call} on rank {rank} with {local.tolist()} returned {result.tolist()}; expected the {op} over"
                f" {world} rank(s): {expected[op].tolist()}."
            )
    if not isinstance(unknown_error, (ValueError, TypeError)):
        seen = "returned without an error" if unknown_error is None else f"raised {type(unknown_error).__name__}"
        problems.append(
            f"reduce(tensor, reduce_op='median') {seen}; an unknown reduce_op must raise ValueError"
            " naming the valid ones."
        )
    _fail(problems)


def check_all_gather(strategy: Strategy, *, rank: int | None = None, world_size: int | None = None) -> None:
    """``all_gather`` stacks every rank's tensor in rank order, differentiably with ``sync_grads=True``.

    On one process the tensor may also come back unchanged (SingleDeviceStrategy does that; a process group of one,
    as DDP on one device, stacks it, as Lightning's strategies do).
    """
    rank, world = _ranks(strategy, rank, world_size)
    matrix = torch.tensor([[float(rank), rank + 0.5, -float(rank)]])
    gathered, gather_error = _attempt(lambda: strategy.all_gather(matrix.clone()))
    scalar, scalar_error = _attempt(lambda: strategy.all_gather(torch.tensor(float(rank))))
    leaf = torch.tensor([rank + 1.0], requires_grad=True)

    def differentiable() -> Any:
        strategy.all_gather(leaf, sync_grads=True).sum().backward()
        return leaf.grad

    gradient, gradient_error = _attempt(differentiable)
    objects, objects_error = _attempt(lambda: strategy.all_gather_object({"rank": rank}))
    problems = []
    expected_matrix = torch.stack([torch.tensor([[float(r), r + 0.5, -float(r)]]) for r in range(world)])
    expected_scalar = torch.arange(world, dtype=torch.float32)
    for call, result, error, expected in (
        ("all_gather(tensor of shape (1, 3))", gathered, gather_error, expected_matrix),
        ("all_gather(scalar tensor)", scalar, scalar_error, expected_scalar),
    ):
        if error is not None:
            problems.append(_raised(call, error))
            continue
        if world == 1 and isinstance(result, torch.Tensor) and result.shape == expected.shape[1:]:
            # One process: unchanged (no process group) and stacked (a group of one) both conform.
            result = result.unsqueeze(0)
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(expected.shape):
            shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            wanted = f"{tuple(expected.shape)}, one entry per rank in rank order" + (
                f", or {tuple(expected.shape[1:])} unchanged" if world == 1 else ""
            )
            problems.append(f"{call} on rank {rank} returned shape {shape}; expected {wanted}.")
        elif not torch.equal(result.detach().cpu(), expected):
            problems.append(
                f"{call} on rank {rank} returned {result.tolist()}; expected {expected.tolist()}"
                " (rank r's tensor at index r)."
            )
    if gradient_error is not None:
        problems.append(_raised("all_gather(tensor, sync_grads=True).sum().backward()", gradient_error))
    elif gradient is None or not torch.equal(gradient.cpu(), torch.tensor([float(world)])):
        problems.append(
            f"all_gather(tensor, sync_grads=True).sum().backward() gave the input the gradient {gradient!r} on rank"
            f" {rank}; expected {float(world)} (each rank's sum uses it once)."
        )
    if objects_error is not None:
        problems.append(_raised("all_gather_object(obj)", objects_error))
    elif objects != [{"rank": r} for r in range(world)]:
        problems.append(
            f"all_gather_object({{'rank': {rank}}}) returned {objects!r}; expected one object per rank, in rank order."
        )
    _fail(problems)


def _payload(rank: int) -> dict[str, Any]:
    return {"from": rank, "text": f"sent by rank {rank}", "values": [rank, 2 * rank]}


def check_broadcast(strategy: Strategy, *, rank: int | None = None, world_size: int | None = None) -> None:
    """``broadcast(obj, src)`` returns rank ``src``'s object on every rank, for every ``src``; tensors too."""
    rank, world = _ranks(strategy, rank, world_size)
    received = [
        (src, *_attempt(lambda src=src: strategy.broadcast(_payload(rank), src=src)))  # type: ignore[misc]  # a default argument binds the loop variable; mypy cannot type such a lambda
        for src in range(world)
    ]
    default, default_error = _attempt(lambda: strategy.broadcast(_payload(rank)))
    tensor, tensor_error = _attempt(lambda: strategy.broadcast(torch.tensor([float(rank), 7.0]), src=world - 1))
    problems = []
    for src, result, error in received:
        if error is not None:
            problems.append(_raised(f"broadcast(obj, src={src})", error))
        elif result != _payload(src):
            problems.append(
                f"broadcast(obj, src={src}) on rank {rank} returned {result!r};"
                f" expected rank {src}'s object {_payload(src)!r}."
            )
    if default_error is not None:
        problems.append(_raised("broadcast(obj)", default_error))
    elif default != _payload(0):
        problems.append(
            f"broadcast(obj) on rank {rank} returned {default!r};"
            f" the default src=0 must send rank 0's object {_payload(0)!r}."
        )
    if tensor_error is not None:
        problems.append(_raised(f"broadcast(tensor, src={world - 1})", tensor_error))
    elif not isinstance(tensor, torch.Tensor) or not torch.equal(tensor.cpu(), torch.tensor([float(world - 1), 7.0])):
        problems.append(
            f"broadcast(tensor, src={world - 1}) on rank {rank} returned {tensor!r}; expected rank {world - 1}'s"
            f" tensor [{float(world - 1)}, 7.0]."
        )
    _fail(problems)


def check_barrier(strategy: Strategy, *, rank: int | None = None, world_size: int | None = None) -> None:
    """``barrier`` holds every rank until the last arrives: the last rank sleeps first, the others must wait for it."""
    rank, world = _ranks(strategy, rank, world_size)
    if world == 1:
        _, error = _attempt(lambda: strategy.barrier("conformance"))
        _fail([_raised("barrier('conformance')", error)] if error is not None else [])
        return
    _synchronise(strategy)
    start = time.monotonic()
    if rank == world - 1:
        time.sleep(BARRIER_SLEEP_S)
    _, error = _attempt(lambda: strategy.barrier("conformance"))
    waited = time.monotonic() - start
    if error is not None:
        raise AssertionError(_raised("barrier('conformance')", error))
    if rank != world - 1 and waited < BARRIER_MIN_WAIT_S:
        raise AssertionError(
            f"barrier() on rank {rank} returned after {waited:.3f} s although rank {world - 1} slept"
            f" {BARRIER_SLEEP_S} s before calling it; a barrier must not return before every rank has reached it"
            f" (expected >= {BARRIER_MIN_WAIT_S} s)."
        )


def _synchronise(strategy: Strategy) -> None:
    """Line the ranks up through torch.distributed itself, not through the strategy under test."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(torch.zeros(1))
    else:
        strategy.reduce(torch.zeros(1), reduce_op="sum")


def check_reduce_boolean_decision(
    strategy: Strategy, *, rank: int | None = None, world_size: int | None = None
) -> None:
    """``reduce_boolean_decision`` is True when every rank (``all=True``) or any rank (``all=False``) decided True."""
    rank, world = _ranks(strategy, rank, world_size)
    cases = [
        ("only rank 0 decides True", lambda r: r == 0),
        ("every rank decides True", lambda r: True),
        ("no rank decides True", lambda r: False),
        ("every rank but rank 0 decides True", lambda r: r != 0),
    ]
    outcomes = []
    for description, decide in cases:
        for every in (True, False):
            result, error = _attempt(
                lambda decide=decide, every=every: strategy.reduce_boolean_decision(decide(rank), all=every)  # type: ignore[misc]  # a default argument binds the loop variable; mypy cannot type such a lambda
            )
            expected = (all if every else any)(decide(r) for r in range(world))
            outcomes.append((description, every, result, error, expected))
    problems = []
    for description, every, result, error, expected in outcomes:
        call = f"reduce_boolean_decision(decision, all={every}) when {description}"
        if error is not None:
            problems.append(_raised(call, error))
        elif result is not expected and result != expected:
            problems.append(f"{call} returned {result!r} on rank {rank}; expected {expected} over {world} rank(s).")
        elif not isinstance(result, bool):
            problems.append(f"{call} returned a {type(result).__name__}; expected a bool.")
    _fail(problems)


#: The collective checks by name, as ``run_conformance(checks=...)`` selects them.
COLLECTIVE_CHECKS: dict[str, Callable[..., None]] = {
    "reduce": check_reduce,
    "all_gather": check_all_gather,
    "broadcast": check_broadcast,
    "barrier": check_barrier,
    "reduce_boolean_decision": check_reduce_boolean_decision,
}

__all__ = [
    "COLLECTIVE_CHECKS",
    "NotApplicable",
    "check_all_gather",
    "check_barrier",
    "check_broadcast",
    "check_reduce",
    "check_reduce_boolean_decision",
]
