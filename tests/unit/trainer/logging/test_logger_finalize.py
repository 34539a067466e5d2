"""Every logger is finalised when a run ends, also after another one's ``finalize`` raised, and the error that ended
the run stays the one raised (Trainer and Cohort): a failing logger costs the others neither their data
(``metrics.csv``) nor the training error, whose notes name every logger that failed."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders

import phalanx
from phalanx.loggers import CSVLogger, Logger
from phalanx.trainer.state import TrainerStatus


class Finalizing(Logger):
    """Records its finalize calls; raises from finalize when given an error to raise."""

    def __init__(self, name: str, error: BaseException | None = None) -> None:
        self._name, self.error, self.finalized = name, error, []

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.finalized.append(status)
        if self.error is not None:
            raise self.error


class FailsInTraining(Regressor):
    """Trains one batch (logged), then fails: the training error."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise ZeroDivisionError("training failed at batch 1")
        return super().training_step(batch, batch_idx)


def _run_trainer(root: Path, loggers: list[Logger], fails: bool) -> phalanx.Trainer:
    # The defaults are on (checkpointing, progress bar, summary, sanity check); only the loggers are chosen.
    trainer = phalanx.Trainer(accelerator="cpu", default_root_dir=root, logger=loggers, max_steps=3,
                              log_every_n_steps=1)  # fmt: skip
    model = FailsInTraining() if fails else Regressor()
    try:
        trainer.fit(model, *loaders(n=32))
    finally:
        assert trainer.state.status == TrainerStatus.FAILED
    return trainer


def _run_cohort(root: Path, loggers: list[Logger], fails: bool) -> None:
    def loop(cohort: phalanx.Cohort) -> None:
        cohort.log("loss", 0.5, step=0)
        if fails:
            raise ZeroDivisionError("training failed at batch 1")

    phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1, loggers=loggers).launch(loop)


#: Which loggers raise from finalize, around a CSVLogger that must still write its rows.
FAILING = {
    "first": [0],
    "last": [2],
    "both": [0, 2],
}


@pytest.mark.parametrize("fails", [True, False], ids=["training fails", "training succeeds"])
@pytest.mark.parametrize("failing", list(FAILING))
@pytest.mark.parametrize("driver", ["trainer", "cohort"])
def test_every_logger_is_finalised_and_the_first_error_is_raised_with_the_others_as_notes(
    tmp_path: Path, driver: str, failing: str, fails: bool
) -> None:
    errors = {index: OSError(f"logger {index} cannot reach its server") for index in FAILING[failing]}
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    loggers = [Finalizing("a", errors.get(0)), csv_logger, Finalizing("c", errors.get(2))]
    with pytest.raises(BaseException) as raised:
        (_run_trainer if driver == "trainer" else _run_cohort)(tmp_path, loggers, fails)
    status = "failed" if fails else "success"
    assert loggers[0].finalized == loggers[2].finalized == [status]  # each finalised once, none skipped
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as file:
        assert [row for row in csv.DictReader(file) if row.get("loss") or row.get("train_loss")]
    expected = list(errors.values())
    if fails:  # the training error is raised; every logger failure is a note on it
        assert isinstance(raised.value, ZeroDivisionError) and "training failed" in str(raised.value)
        noted = expected
    else:  # the first logger failure is raised; the later ones are notes on it
        assert raised.value is expected[0]
        noted = expected[1:]
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == len(noted)
    for note, error in zip(notes, noted):
        assert f"Finalizing.finalize({status!r}) also raised OSError: {error}" in note
