"""HSDPFaultTolerantStrategy in one process: its name, its data shares, what it refuses, and the live state a healthy
process sends a rejoining one (its shards as plain tensors, put back on the receiver's mesh, and its LR schedulers'
states)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor

from phalanx.optimization import LRSchedulerConfig
from phalanx.plugins.environments.default import DefaultEnvironment
from phalanx.strategies import STRATEGY_REGISTRY, FaultTolerance, HSDPFaultTolerantStrategy, RunSettings, SemiSync

pytest.importorskip("torchft")


def _strategy(group: int = 1, groups: int = 3, world_size: int = 1, **options: Any) -> HSDPFaultTolerantStrategy:
    environment = DefaultEnvironment()
    environment.set_world_size(world_size)
    return HSDPFaultTolerantStrategy(
        cluster_environment=environment,
        parallel_devices=[torch.device("cpu")] * world_size,
        fault_tolerance=FaultTolerance(replica_group_id=group, num_replica_groups=groups, **options),
    )


def test_hsdp_ft_is_registered_and_reads_its_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    strategy = STRATEGY_REGISTRY.get("hsdp_ft")
    assert isinstance(strategy, HSDPFaultTolerantStrategy)
    assert strategy.fault_tolerance == FaultTolerance(replica_group_id=1, num_replica_groups=2)
    assert strategy.traits.cohort_unsupported


@pytest.mark.parametrize(("group", "groups", "world_size"), [(0, 1, 1), (1, 3, 1), (0, 2, 2), (1, 2, 2)])
def test_each_process_of_each_group_reads_its_own_share(group, groups, world_size):
    strategy = _strategy(group, groups, world_size)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": groups * world_size, "rank": group * world_size}
    assert strategy.is_global_zero == (group == 0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"sharding_strategy": "HYBRID_SHARD"}, ValueError, r"sharding_strategy='HYBRID_SHARD'.*FULL_SHARD"),
        ({"sharding_strategy": "NO_SHARD"}, ValueError, r"sharding_strategy='NO_SHARD'"),
        ({"state_dict_type": "sharded"}, ValueError, r"state_dict_type='full'"),
        ({"fault_tolerance": {"replica_group_id": 0}}, TypeError, r"takes a FaultTolerance, got dict"),
    ],
    ids=["hybrid", "no-shard", "sharded-checkpoints", "options-of-another-type"],
)
def test_options_it_cannot_run_are_refused(options, error, message):
    with pytest.raises(error, match=message):
        HSDPFaultTolerantStrategy(**options)


class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("module", "options", "message"),
    [
        (Manual, {}, r"automatic optimization only"),
        (Regressor, {"semi_sync": SemiSync("local_sgd", 2)}, r"semi_sync=...\) is offered by strategy='ddp_ft' only"),
        (Regressor, {}, None),
    ],
    ids=["manual-optimization", "semi-sync", "accepted"],
)
def test_check_setup_refuses_what_this_release_does_not_run(module, options, message):
    strategy = _strategy(world_size=2, **options)
    strategy.connect(module())
    if message is None:
        strategy.check_setup(RunSettings())
        return
    with pytest.raises(ValueError, match=message):
        strategy.check_setup(RunSettings())


@pytest.fixture
def one_process_group():
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _sharded(seed: int, scheduler_steps: int = 0) -> tuple[HSDPFaultTolerantStrategy, torch.nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    module = Regressor()
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(4, 4)).sum().backward()
    optimizer.step()  # momentum buffers exist, as DTensors like the parameters
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(scheduler_steps):
        optimizer.step()
        scheduler.step()
    strategy = _strategy()
    strategy.connect(module)
    strategy.optimizers = [optimizer]
    strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler=scheduler, interval="step")]
    return strategy, module


@pytest.mark.usefixtures("one_process_group")
def test_the_live_state_goes_as_plain_shards_and_lands_on_the_receivers_mesh():
    sender, sent_module = _sharded(seed=1, scheduler_steps=3)
    receiver, received_module = _sharded(seed=2)
    state = sender._live_state()
    tensors = [*state["module"].values(), *state["optimizers"][0]["state"][0].values()]
    assert all(type(tensor) is torch.Tensor for tensor in tensors)  # no DTensor (and no mesh) goes over the wire
    receiver._load_live_state(state)
    for got, want in zip(received_module.parameters(), sent_module.parameters(), strict=True):
        assert torch.equal(got.full_tensor(), want.full_tensor())
    got_state, want_state = receiver.optimizers[0].state, sender.optimizers[0].state
    for got_param, want_param in zip(received_module.parameters(), sent_module.parameters(), strict=True):
        got, want = got_state[got_param]["momentum_buffer"], want_state[want_param]["momentum_buffer"]
        assert got.placements == want.placements and torch.equal(got.full_tensor(), want.full_tensor())
    got_scheduler, want_scheduler = (s.lr_scheduler_configs[0].scheduler.state_dict() for s in (receiver, sender))
    assert got_scheduler == want_scheduler and want_scheduler["last_epoch"] == 3
    assert receiver.optimizers[0].param_groups[0]["lr"] == sender.optimizers[0].param_groups[0]["lr"] == 0.05
