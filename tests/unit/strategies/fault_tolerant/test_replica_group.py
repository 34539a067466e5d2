"""ReplicaGroup, the quorum membership ddp_ft and hsdp_ft share: the order in which a group's processes start their
torchft Managers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from phalanx.plugins.environments.default import DefaultEnvironment
from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance, HSDPFaultTolerantStrategy, RunSettings

pytest.importorskip("torchft")

from phalanx.strategies.fault_tolerant.replica_group import GroupProcess, ReplicaGroup  # noqa: E402


def _strategy(cls: type, rank: int, world_size: int) -> Any:
    environment = DefaultEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    return cls(
        cluster_environment=environment,
        parallel_devices=[torch.device("cpu")] * world_size,
        fault_tolerance=FaultTolerance(replica_group_id=0, num_replica_groups=1),
    )


@pytest.mark.parametrize("cls", [DDPFaultTolerantStrategy, HSDPFaultTolerantStrategy], ids=["ddp_ft", "hsdp_ft"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_other_ranks_make_their_manager_after_rank_zero_wrote_its_address(monkeypatch, cls, world_size):
    # torchft's Manager: rank 0 writes its manager's address to the group's store, the other ranks read it there. The
    # store still holds the address of an earlier fit's manager (shut down): a rank that reads before rank 0 wrote the
    # new one would reach no manager. Rank 0's write here waits until every other rank has moved on (made its manager,
    # or reached the barrier), so that reading too early is caught every time, not by chance.
    store = {"manager_addr": "the earlier fit's manager"}
    moved, changed = [], threading.Condition()
    barrier = threading.Barrier(world_size, timeout=60)

    def move_on(rank: int) -> None:
        with changed:
            moved.append(rank)
            changed.notify_all()

    def make_manager(group: ReplicaGroup, process: GroupProcess) -> str:
        if process.rank == 0:
            with changed:
                assert changed.wait_for(lambda: len(moved) == world_size - 1, timeout=60)
            store["manager_addr"] = "this fit's manager"
            return "this fit's manager"
        move_on(process.rank)
        return store["manager_addr"]

    def wait_at_barrier(rank: int, name: str) -> None:
        if rank:
            move_on(rank)
        barrier.wait()

    monkeypatch.setattr(ReplicaGroup, "make_manager", make_manager)

    def join(rank: int) -> Any:
        strategy = _strategy(cls, rank, world_size)
        process = GroupProcess(rank, world_size, torch.device("cpu"), dict, lambda state: None)
        strategy._replica_group.start(RunSettings(), process, None, lambda name: wait_at_barrier(rank, name))
        return strategy.manager

    with ThreadPoolExecutor(world_size) as pool:
        managers = list(pool.map(join, range(world_size)))
    assert managers == ["this fit's manager"] * world_size
