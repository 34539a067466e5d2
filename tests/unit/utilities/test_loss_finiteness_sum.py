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


def test_a_recorded_loss_runs_no_device_operation_until_a_fold():
    watch = LossFinitenessSum()
    weight = torch.ones(2, requires_grad=True)
    losses = [(weight * 3).sum() for _ in range(LossFinitenessSum.FOLD_EVERY - 1)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for loss in losses:
            watch.record(loss)
    names = {event.name for event in profile.events() if event.name.startswith("aten::")}
    assert not names & {"aten::add_", "aten::stack", "aten::sum", "aten::zeros"}, names


@pytest.mark.parametrize("bad_at", [None, 0, 5, LossFinitenessSum.FOLD_EVERY - 1, LossFinitenessSum.FOLD_EVERY, 150])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_window_longer_than_a_fold_finds_a_nonfinite_loss_wherever_it_is(bad_at, bad):
    watch = LossFinitenessSum()
    for index in range(2 * LossFinitenessSum.FOLD_EVERY + 30):
        watch.record(torch.tensor(bad if index == bad_at else 1.0))
    assert watch.recorded == 2 * LossFinitenessSum.FOLD_EVERY + 30
    assert watch.read() is (bad_at is None)
    watch.record(torch.tensor(2.0))  # the next window starts clean
    assert watch.read() is True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_finite_16_bit_losses_whose_sum_overflows_their_dtype_stay_finite(dtype):
    watch = LossFinitenessSum()
    for _ in range(LossFinitenessSum.FOLD_EVERY + 3):
        watch.record(torch.tensor(60000.0, dtype=dtype))  # 64 of them overflow float16 (max 65504)
    assert watch.read() is True


def test_a_read_inside_inference_mode_leaves_a_sum_that_later_windows_can_update():
    # The Trainer reads the sum where it saves a checkpoint, which may be at the end of a validation run (inference
    # mode); the next training window adds to the same sum outside it.
    watch = LossFinitenessSum()
    for _ in range(3):
        watch.record(torch.tensor(1.0))
        with torch.inference_mode():
            assert watch.read() is True
    for _ in range(LossFinitenessSum.FOLD_EVERY + 1):
        watch.record(torch.tensor(1.0))
    watch.record(torch.tensor(math.nan))
    assert watch.read() is False
