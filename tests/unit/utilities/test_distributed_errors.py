"""Failures inside collectives become errors that name the operation, the rank and the timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest

from phalanx.utilities.distributed import CollectiveError, naming_collective_failures, run_collective

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"
    " operation to complete"
)
NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for"
    " 600000 milliseconds"
)
GLOO_PEER = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


@pytest.mark.parametrize(
    ("raised", "transport_only", "expected"),
    [
        (RuntimeError(GLOO_TIMEOUT), True, "timed out after 0:00:10"),
        (RuntimeError(NCCL_TIMEOUT), True, "timed out after 0:00:10"),
        (RuntimeError(GLOO_PEER), True, "another process left the job"),
        (RuntimeError(GLOO_TIMEOUT), False, "timed out after 0:00:10"),
        (RuntimeError("my data source timed out"), False, "timed out after 0:00:10"),  # inside a named collective
        (RuntimeError("my data source timed out"), True, None),  # a user's own error in a step keeps its text
        (RuntimeError("shape mismatch"), True, None),
        (ValueError(GLOO_TIMEOUT), True, None),
        (CollectiveError("The collective 'barrier' on rank 0 timed out"), True, None),
    ],
)
def test_only_collective_failures_are_renamed(raised, transport_only, expected):
    with pytest.raises(type(raised) if expected is None else CollectiveError) as caught:
        with naming_collective_failures(
            "DDP gradient all-reduce (backward)", 0, timedelta(seconds=10), transport_only=transport_only
        ):
            raise raised
    if expected is None:
        assert caught.value is raised
    else:
        message = str(caught.value)
        assert "'DDP gradient all-reduce (backward)' on rank 0" in message and expected in message
        assert message.count("\n") == 0  # one line: the transport's source location is kept, its trace is not
        if "timed out" in expected:
            assert "timeout= argument" in message


def test_run_collective_returns_the_result_and_names_failures():
    assert run_collective("broadcast", 1, None, lambda: 42) == 42
    with pytest.raises(CollectiveError, match=r"'broadcast' on rank 1 timed out after None"):
        run_collective("broadcast", 1, None, lambda: (_ for _ in ()).throw(RuntimeError(GLOO_TIMEOUT)))
