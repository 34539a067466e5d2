"""The learning-rate schedulers' part of a fault-tolerant group's live state: a joining group that loads its peer's
schedulers (after the optimizer state) steps the same learning rates as the peer from then on."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.optim import SGD, Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, MultiStepLR, OneCycleLR, StepLR

from phalanx.optimization import LRSchedulerConfig, load_scheduler_states, scheduler_states
from phalanx.strategies.fault_tolerant.replica_group import PEER_STATE

SCHEDULERS = [
    pytest.param(lambda o: StepLR(o, step_size=3, gamma=0.5), id="StepLR"),
    pytest.param(lambda o: MultiStepLR(o, milestones=[2, 5], gamma=0.1), id="MultiStepLR"),
    pytest.param(lambda o: CosineAnnealingLR(o, T_max=10), id="CosineAnnealingLR"),
    pytest.param(lambda o: OneCycleLR(o, max_lr=0.5, total_steps=12), id="OneCycleLR"),
]


def _group(make: Callable[[Optimizer], Any]) -> tuple[Optimizer, list[LRSchedulerConfig]]:
    optimizer = SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    return optimizer, [LRSchedulerConfig(scheduler=make(optimizer), interval="step")]


def _step(optimizer: Optimizer, configs: list[LRSchedulerConfig], steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        configs[0].scheduler.step()
    return rates


@pytest.mark.parametrize("make", SCHEDULERS)
@pytest.mark.parametrize("peer_steps", [1, 4])
def test_a_joining_group_steps_its_peers_learning_rates(make: Callable[[Optimizer], Any], peer_steps: int) -> None:
    peer, peer_configs = _group(make)
    _step(peer, peer_configs, peer_steps)
    joining, joining_configs = _group(make)
    joining.load_state_dict(peer.state_dict())  # the optimizer state comes first, as in _load_live_state
    load_scheduler_states(joining_configs, scheduler_states(peer_configs), PEER_STATE)
    assert joining_configs[0].scheduler.state_dict() == peer_configs[0].scheduler.state_dict()
    assert _step(joining, joining_configs, 6) == _step(peer, peer_configs, 6)


@pytest.mark.parametrize("make", SCHEDULERS)
def test_without_the_schedulers_state_the_joining_group_would_step_other_rates(
    make: Callable[[Optimizer], Any],
) -> None:
    # What the fix is for: the optimizer state alone leaves the joining group's schedule at its start.
    peer, peer_configs = _group(make)
    _step(peer, peer_configs, 4)
    joining, joining_configs = _group(make)
    joining.load_state_dict(peer.state_dict())
    assert _step(joining, joining_configs, 6) != _step(peer, peer_configs, 6)


@pytest.mark.parametrize(("sent", "live"), [(0, 1), (2, 1), (1, 0)])
def test_another_number_of_schedulers_is_refused(sent: int, live: int) -> None:
    _, peer_configs = _group(SCHEDULERS[0].values[0])
    _, configs = _group(SCHEDULERS[0].values[0])
    with pytest.raises(
        ValueError,
        match=f"peer replica group sent holds the states of {sent} learning-rate scheduler.*configure_optimizers made",
    ):
        load_scheduler_states(configs[:live], scheduler_states(peer_configs) * sent, PEER_STATE)


def test_a_peer_that_sent_no_scheduler_state_changes_nothing() -> None:
    optimizer, configs = _group(SCHEDULERS[0].values[0])
    before = configs[0].scheduler.state_dict()
    load_scheduler_states(configs, None, PEER_STATE)
    assert configs[0].scheduler.state_dict() == before
