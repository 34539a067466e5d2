"""The cross-group process group of ddp_ft: its rendezvous waits connect_timeout, its collectives step_timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable
from unittest.mock import MagicMock

import pytest
import torch
import torch.distributed as dist

from phalanx.strategies import FaultTolerance
from phalanx.strategies.fault_tolerant.replica_group import GroupProcess, ReplicaGroup

torchft = pytest.importorskip("torchft")

RENDEZVOUS = timedelta(seconds=2)
STEP = timedelta(seconds=120)


def _group(monkeypatch: pytest.MonkeyPatch, group: int) -> Any:
    """The process group that replica group ``group`` hands its torchft Manager (the Manager itself is not started)."""
    manager = MagicMock()
    monkeypatch.setattr(torchft.manager, "Manager", manager)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    options = FaultTolerance(group, 2, connect_timeout=RENDEZVOUS, step_timeout=STEP)
    process = GroupProcess(0, 1, torch.device("cpu"), dict, lambda state: None)
    ReplicaGroup("DDPFaultTolerantStrategy", "ddp_ft", options).make_manager(process)
    return manager.call_args.kwargs["pg"]


def _in_thread(work: Callable[[], Any]) -> dict[str, Any]:
    """Run ``work`` in a thread; what it returned or raised (a hang past a generous bound fails the test)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=STEP.total_seconds() / 2)
    assert not thread.is_alive(), "waited past the rendezvous bound: the step timeout bounds the rendezvous"
    return outcome


def test_a_rendezvous_whose_peer_died_gives_up_after_connect_timeout_not_step_timeout(monkeypatch):
    # The peer group asked for the quorum and was killed before its rendezvous: the survivor waits for its key.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = _group(monkeypatch, 0)
    outcome = _in_thread(lambda: group.configure(f"127.0.0.1:{store.port}/torchft/1/0", "phalanx_group_0", 0, 2))
    assert "error" in outcome
    assert f"{int(RENDEZVOUS.total_seconds() * 1000)}ms" in str(outcome["error"])


COLLECTIVES = {
    "allreduce": lambda group, tensor: group.allreduce([tensor], dist.AllreduceOptions()),
    "broadcast": lambda group, tensor: group.broadcast([tensor], dist.BroadcastOptions()),
}


@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_a_collective_waits_step_timeout_for_a_slower_group(monkeypatch, collective):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [_group(monkeypatch, rank) for rank in range(2)]
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]

    def member(rank: int) -> Callable[[], Any]:
        def work() -> Any:
            groups[rank].configure(f"127.0.0.1:{store.port}/torchft/1/0", f"phalanx_group_{rank}", rank, 2)
            if rank == 1:  # the slower group comes to the collective later than the rendezvous bound
                time.sleep(RENDEZVOUS.total_seconds() * 1.5)
            COLLECTIVES[collective](groups[rank], tensors[rank]).wait()
            return tensors[rank].tolist()

        return work

    outcomes: list[dict[str, Any]] = [{}, {}]
    threads = [
        threading.Thread(target=lambda r=rank: outcomes.__setitem__(r, _in_thread(member(r)))) for rank in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = [3.0] * 3 if collective == "allreduce" else [1.0] * 3
    assert [outcome.get("result", outcome.get("error")) for outcome in outcomes] == [expected, expected]
