"""``trainer.log_every_n_steps`` assigned during fit (by a callback) takes effect at once, as in Lightning, which reads
it at every step: the loop must not keep the value it read at the epoch's start. The logging decision follows the
``on_train_batch_end`` hooks, so an assignment there already counts for that step."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

import phalanx
from phalanx.loggers import Logger


class StepsLogger(Logger):
    """Records the step of every ``train_loss`` write; writes no files."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "train_loss" in metrics and step is not None:
            self.steps.append(step)

    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        pass


class SetLogEvery(phalanx.Callback):
    """Assigns ``trainer.log_every_n_steps = value`` at the end of the batch numbered ``at`` (0-based, epoch 0)."""

    def __init__(self, at: int, value: int) -> None:
        self.at, self.value = at, value

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.at:
            trainer.log_every_n_steps = self.value


@pytest.mark.parametrize(
    ("initial", "at", "new", "logged"),
    [
        (50, 1, 1, [1, 2, 3, 4, 5, 6, 7]),  # from "never in this epoch" to every step, the assigning step included
        (1, 3, 4, [0, 1, 2, 3, 7]),  # from every step to every 4th: steps 4-6 are not written
        (2, 2, 3, [1, 2, 5]),  # window 2 then 3, counted on the steps taken since the fit began (3rd and 6th)
    ],
    ids=["50 to 1", "1 to 4", "2 to 3"],
)
def test_an_assignment_in_a_callback_counts_from_its_own_step(initial, at, new, logged):
    logger = StepsLogger()
    phalanx.seed_everything(0)
    trainer = quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=initial, callbacks=[SetLogEvery(at, new)])
    trainer.fit(Regressor(), DataLoader(regression_data(32), batch_size=4))  # 8 optimizer steps
    assert logger.steps == logged
