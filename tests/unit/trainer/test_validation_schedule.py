"""When validation runs inside an epoch: a fractional val_check_interval means what it means in Lightning."""

from __future__ import annotations

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset


class _Counting(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.fit_loop.batches_done)


@pytest.mark.parametrize(
    ("interval", "expected"),
    [(0.3, [9, 18, 27]), (0.25, [8, 16, 24, 32]), (0.5, [16, 32]), (1.0, [32]), (0.99, [31]), (10, [10, 20, 30])],
)
def test_validation_runs_at_each_interval_and_not_again_at_the_epoch_end(interval, expected):
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model = _Counting()
    trainer = quiet_trainer(max_epochs=1, val_check_interval=interval, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data, batch_size=1), DataLoader(data, batch_size=8))
    assert model.validated_at == expected


def _schedule(
    every: int | None,
    interval: int | float = 1.0,
    every_n_epochs: int | None = 1,
    across: bool = False,
    enabled: bool = True,
):
    from types import SimpleNamespace

    from phalanx.trainer.state import RunState

    run = RunState(val_every_batches=every, val_across_epochs=across, validation_enabled=enabled)
    return SimpleNamespace(
        _run=run, val_check_interval=interval, check_val_every_n_epoch=every_n_epochs, validation_enabled=enabled
    )


def _loop(epoch: int, batches_done: int, total: int, last_validated_at: int = -1):
    from types import SimpleNamespace

    return SimpleNamespace(
        current_epoch=epoch, batches_done=batches_done, total_batches=total, _last_validated_at=last_validated_at
    )


# (schedule, loop, is_last, due after the batch?, due at the epoch's end?)
SCHEDULES = [
    (_schedule(every=None), _loop(0, 4, 4), True, False, True),  # 1.0: once, at the epoch's end
    (_schedule(every=None, enabled=False), _loop(0, 4, 4), True, False, False),
    (_schedule(every=3, interval=0.3), _loop(0, 3, 3), False, True, True),  # an epoch of 3 batches ends at 3
    (_schedule(every=3, interval=0.3), _loop(0, 10, 10), True, False, False),  # 10 of 10 batches: not a multiple of 3
    (_schedule(every=3, interval=0.3), _loop(0, 9, 9, last_validated_at=9), True, False, False),  # already validated
    (_schedule(every=5, interval=5), _loop(0, 5, 5), False, True, True),
    (_schedule(every=5, interval=5), _loop(0, 5, 5, last_validated_at=5), True, False, False),
    (_schedule(every=5, interval=5, every_n_epochs=2), _loop(0, 5, 5), False, False, False),  # epoch 1 of 2: no
    (_schedule(every=5, interval=5, every_n_epochs=2), _loop(1, 5, 10), False, True, True),
    (_schedule(every=4, interval=4, every_n_epochs=None, across=True), _loop(1, 1, 8), False, True, False),
    (_schedule(every=4, interval=4, every_n_epochs=None, across=True), _loop(1, 2, 9), True, False, False),
]


@pytest.mark.parametrize(("schedule", "loop", "is_last", "after_batch", "at_epoch_end"), SCHEDULES)
def test_validation_due_after_a_batch_and_at_the_epoch_end(schedule, loop, is_last, after_batch, at_epoch_end):
    from phalanx.trainer.loops.fit_data import epoch_end_validation_due, val_check_due

    assert val_check_due(schedule, loop, is_last=is_last) is after_batch
    assert epoch_end_validation_due(schedule, loop) is at_epoch_end
