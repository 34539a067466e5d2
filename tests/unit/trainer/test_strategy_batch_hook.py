"""The fit loop calls ``Strategy.on_train_batch_start(batch, batch_idx)`` on every training batch, after the module's
and the callbacks' hook (as Lightning does), also for the batch on which the module's hook returns -1."""

from __future__ import annotations

from typing import Any

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.strategies import SingleDeviceStrategy


class RecordingStrategy(SingleDeviceStrategy):
    def __init__(self, calls: list[tuple[str, int]]) -> None:
        super().__init__()
        self.calls = calls
        self.batches: list[Any] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls.append(("strategy", batch_idx))
        self.batches.append(batch)


class StoppingRegressor(Regressor):
    def __init__(self, calls: list[tuple[str, int]], stop_at: int | None) -> None:
        super().__init__()
        self.calls, self.stop_at = calls, stop_at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        self.calls.append(("module", batch_idx))
        return -1 if batch_idx == self.stop_at else None


@pytest.mark.parametrize(("stop_at", "batches"), [(None, [0, 1, 2, 3]), (2, [0, 1, 2]), (0, [0])])
def test_strategy_hook_follows_the_module_hook_on_every_batch(stop_at: int | None, batches: list[int]) -> None:
    calls: list[tuple[str, int]] = []
    strategy = RecordingStrategy(calls)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_train_batches=4)
    trainer.fit(StoppingRegressor(calls, stop_at), loaders(n=64, batch_size=8)[0])
    assert calls == [(who, index) for index in batches for who in ("module", "strategy")]
    x, y = strategy.batches[0]
    assert tuple(x.shape) == (8, 4) and x.device == strategy.root_device  # the batch as training_step receives it
