"""LossFinitenessSum: the device-side sum of losses, and the one detach it shares with the driver that recorded."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.utilities.nonfinite import LossFinitenessSum


@pytest.mark.parametrize(
    ("losses", "finite"),
    [([1.0, 2.0], True), ([1.0, math.nan], False), ([math.inf, 1.0], False), ([-math.inf], False), ([], None)],
)
def test_one_read_answers_for_every_recorded_loss(losses, finite):
    watch = LossFinitenessSum()
    for value in losses:
        watch.record(torch.tensor(value, requires_grad=True) * 1.0)
    assert watch.read() is finite
    assert watch.read() is None  # a read starts a new window


def test_the_driver_gets_the_detach_the_record_made_of_the_same_loss_and_a_fresh_one_otherwise():
    watch = LossFinitenessSum()
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 3).sum()
    watch.record(loss)
    first = watch.detached(loss)
    assert not first.requires_grad and first.data_ptr() == loss.data_ptr()
    # Taken once: a second call (or another loss) gets its own detach, so no graph is held past the batch.
    second = watch.detached(loss)
    assert second is not first and not second.requires_grad
    other = (weight * 2).sum()
    watch.record(loss)
    fresh = watch.detached(other)
    assert fresh.data_ptr() == other.data_ptr() and fresh is not first


def test_a_recorded_loss_and_its_kept_copy_cost_one_detach_op():
    watch = LossFinitenessSum()
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 3).sum()
    watch.record(loss)  # the sum's buffer is made on the first record: count from the second on
    watch.detached(loss)
    loss = (weight * 3).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        watch.record(loss)
        watch.detached(loss)
    detaches = [event for event in profile.events() if event.name == "aten::detach"]
    assert len(detaches) == 1
