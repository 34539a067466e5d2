"""A step the strategy declines (``last_step_committed`` False, as a fault-tolerance quorum may) counts nowhere, and
its batch is trained again so that a committed step trains every batch once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.strategies import SingleDeviceStrategy


class DecliningStrategy(SingleDeviceStrategy):
    """Declines the optimizer steps whose number (from 0) is in ``declined``, as a quorum that did not commit."""

    def __init__(self, declined: set[int]) -> None:
        super().__init__()
        self.declined = declined
        self.calls = 0

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        commit = self.calls not in self.declined
        self.calls += 1
        self.last_step_committed = commit
        if commit:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return closure()  # the batch's forward and backward ran; the update did not


class ScheduledRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.trained: list[int] = []  # the batch index of each training_step call

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.append(batch_idx)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _fit(declined: set[int], batches: int, accumulate: int) -> tuple[Any, DecliningStrategy, ScheduledRegressor]:
    model = ScheduledRegressor()
    strategy = DecliningStrategy(declined)
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=batches,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
    )
    train, _ = loaders(n=64, batch_size=8, shuffle=False)
    trainer.fit(model, train)
    return trainer, strategy, model


@pytest.mark.parametrize(
    ("declined", "batches"),
    [(set(), 6), ({0}, 6), ({1, 3}, 6), ({0, 1, 2, 3, 4, 5}, 6)],
    ids=["none", "first", "two", "six in a row"],
)
def test_a_declined_step_trains_its_batch_again_and_counts_once_committed(declined, batches):
    trainer, strategy, model = _fit(declined, batches, accumulate=1)
    assert strategy.calls == batches + len(declined)
    assert sorted(set(model.trained)) == list(range(batches))
    assert len(model.trained) == batches + len(declined)
    # Each declined call is followed by the same batch's next call, until one commits.
    assert all(model.trained[call] == model.trained[call + 1] for call in declined)
    assert trainer.global_step == batches
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**batches)


@pytest.mark.parametrize(("declined", "windows"), [({0}, 3), ({1, 2}, 3)], ids=["first", "two"])
def test_a_declined_step_of_a_longer_window_is_dropped_and_not_counted(declined, windows):
    trainer, strategy, model = _fit(declined, 2 * windows, accumulate=2)
    assert strategy.calls == windows
    assert model.trained == list(range(2 * windows))
    committed = windows - len(declined)
    assert trainer.global_step == committed
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**committed)
