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
