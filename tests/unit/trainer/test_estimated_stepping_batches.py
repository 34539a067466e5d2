"""``trainer.estimated_stepping_batches`` inside ``configure_optimizers``: Lightning's OneCycleLR recipe fits."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

import phalanx

# 64 samples in batches of 8: 8 training batches per epoch.
CASES = [
    # (max_epochs, max_steps, accumulate_grad_batches, limit_train_batches, expected optimizer steps)
    (2, -1, 1, 1.0, 16),
    (3, -1, 3, 1.0, 9),  # ceil(8 / 3) steps per epoch: the last partial window steps too
    (2, 5, 1, 1.0, 5),  # max_steps ends first
    (2, 100, 2, 1.0, 8),  # the epochs end first
    (2, -1, 2, 0.5, 4),  # a fraction of the batches
    (4, -1, 2, 3, 8),  # a number of batches: ceil(3 / 2) per epoch
    (-1, 6, 1, 1.0, 6),  # endless epochs: max_steps
    (None, 7, 2, 1.0, 7),  # max_epochs left unset with max_steps
]


class OneCycle(Regressor):
    """Lightning's documented recipe: OneCycleLR over ``estimated_stepping_batches``, stepped every optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def configure_optimizers(self) -> Any:
        total = self.trainer.estimated_stepping_batches
        self.seen.append(total)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("source", ["loader", "module", "datamodule"])
@pytest.mark.parametrize(("max_epochs", "max_steps", "accumulate", "limit", "expected"), CASES)
def test_configure_optimizers_sees_the_run_s_optimizer_steps(
    source, max_epochs, max_steps, accumulate, limit, expected
):
    model = OneCycle()
    loader = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    trainer = quiet_trainer(
        max_epochs=max_epochs,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_train_batches=limit,
    )
    if source == "loader":
        trainer.fit(model, loader)
    elif source == "module":
        model.train_dataloader = lambda: loader
        trainer.fit(model)
    else:
        trainer.fit(model, datamodule=phalanx.DataModule.from_datasets(train_dataset=loader.dataset, batch_size=8))
    assert model.seen == [expected]
    # OneCycleLR raises when stepped past total_steps: the run took exactly the steps it was told of.
    assert trainer.global_step == expected
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == expected


def test_cosine_annealing_t_max_is_the_run_s_length():
    """CosineAnnealingLR(T_max=estimated_stepping_batches) reaches its minimum at the run's end (not after 1 step)."""

    class Cosine(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            t_max = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    model = Cosine()
    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(model, DataLoader(regression_data(64), batch_size=8))
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.T_max == 16
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_endless_run_without_max_steps_is_infinite():
    class Reads(Regressor):
        def configure_optimizers(self) -> Any:
            self.total = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

    model = Reads()
    quiet_trainer(max_epochs=1).fit(model, DataLoader(regression_data(16), batch_size=8))
    assert model.total == 2
    assert math.isinf(quiet_trainer(max_epochs=-1, max_steps=-1).estimated_stepping_batches)
