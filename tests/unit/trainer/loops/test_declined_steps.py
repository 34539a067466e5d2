"""A step the strategy declines (``last_step_committed`` False, as a fault-tolerance quorum may) counts nowhere."""

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
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize(
    ("declined", "batches"),
    [(set(), 6), ({0}, 6), ({1, 3}, 6), ({0, 1, 2, 3, 4, 5}, 6)],
    ids=["none", "first", "two", "all"],
)
def test_global_step_and_the_scheduler_follow_committed_steps_only(declined, batches):
    model = ScheduledRegressor()
    strategy = DecliningStrategy(declined)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_train_batches=batches, num_sanity_val_steps=0)
    train, _ = loaders(n=64, batch_size=8, shuffle=False)
    trainer.fit(model, train)
    committed = batches - len(declined)
    assert strategy.calls == batches
    assert trainer.global_step == committed
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**committed)
