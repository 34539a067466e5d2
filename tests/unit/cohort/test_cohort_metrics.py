"""Logging from a Cohort loop: Cohort(loggers=...), cohort.log / log_dict, and self.log of a module a Cohort set up."""

from __future__ import annotations

import copy
import csv
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.loggers import CSVLogger, Logger


class Logged(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss, prog_bar=True, on_epoch=True)  # Trainer-only options are accepted and ignored
        self.log("synced", 4.0, sync_dist=True, reduce_fx="max")  # one process: reduced to itself
        self.log_dict({"a": 1, "b": torch.tensor([2.5])})
        self.log("hidden", 9.0, logger=False)
        return loss


class Recorder(Logger):
    """Records log_metrics calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int | None]] = []
        self.finalized: list[str] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((dict(metrics), step))

    def log_hyperparams(self, params: Any) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.finalized.append(status)


def _cohort(loggers: Any) -> phalanx.Cohort:
    return phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1, loggers=loggers)


def _train(cohort: phalanx.Cohort, steps: int) -> Any:
    module = Logged()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for index in range(steps):
        optimizer.zero_grad()
        cohort.backward(model.training_step(torch.ones(3, 2), index))
        optimizer.step()
    return module


def test_values_logged_by_the_module_and_the_loop_land_in_the_csv_when_launch_returns(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="run", version=0, flush_logs_every_n_steps=1000)

    def loop(cohort: phalanx.Cohort) -> None:
        _train(cohort, 2)
        cohort.log("lr", torch.tensor(0.1))  # at global_step 2
        cohort.log_dict({"val": 0.5, "count": 7}, step=10)

    cohort = _cohort(logger)
    cohort.launch(loop)  # finalizes the loggers: the buffered rows are written
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    written = [{key: value for key, value in row.items() if value} for row in rows]
    assert [row["step"] for row in written] == ["0", "0", "0", "1", "1", "1", "2", "10"]
    assert written[1] == {"step": "0", "synced": "4.0"}
    assert written[2] == {"step": "0", "a": "1", "b": "2.5"}  # log_dict: one row
    assert float(written[0]["loss"]) > 0 and float(written[3]["loss"]) < float(written[0]["loss"])
    assert set(written[-2]) == {"step", "lr"} and written[-2]["step"] == "2"
    assert float(written[-2]["lr"]) == pytest.approx(0.1)
    assert written[-1] == {"step": "10", "val": "0.5", "count": "7"}
    assert all("hidden" not in row for row in written)  # logger=False


def test_every_logger_gets_each_entry_and_launch_finalizes_them_by_outcome():
    first, second = Recorder(), Recorder()
    cohort = _cohort([first, second])
    assert cohort.loggers == [first, second] and cohort.logger is first
    cohort.launch(lambda c: c.log("x", 1.5, step=4))
    assert first.calls == second.calls == [({"x": 1.5}, 4)]
    assert first.finalized == ["success"]

    failing = Recorder()
    with pytest.raises(ZeroDivisionError):
        _cohort(failing).launch(lambda c: 1 / 0)
    assert failing.finalized == ["failed"]


def test_without_loggers_self_log_is_silent_and_outside_any_driver_it_still_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(_cohort(None), 1)  # no warning, nothing to write
    with pytest.warns(UserWarning, match="outside a Trainer run"):
        Logged().training_step(torch.ones(1, 2), 0)


def test_a_copy_of_a_set_up_module_carries_no_cohort():
    recorder = Recorder()
    module = _train(_cohort(recorder), 1)
    copied = copy.deepcopy(module)
    with pytest.warns(UserWarning, match="outside a Trainer run"):
        copied.log("x", 1.0)
    module.log("y", 2.0)  # the original still reaches its Cohort
    assert recorder.calls[-1] == ({"y": 2.0}, 1)


@pytest.mark.parametrize(
    ("loggers", "match"),
    [
        (True, r"Cohort\(loggers=True \(of type bool\) is not a Logger; pass None, a phalanx Logger"),
        ("csv", "of type str"),
        (CSVLogger, r"is a class, not an instance; pass an instance, e\.g\. CSVLogger\(save_dir=\.\.\.\)"),
        ([Recorder(), object()], r"loggers\[1\]=.* \(of type object\) is not a Logger"),
    ],
)
def test_bad_loggers_are_refused(loggers, match):
    with pytest.raises(TypeError, match=match):
        _cohort(loggers)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c, m: c.log(3, 1.0), TypeError, "metric names must be non-empty str, got 3"),
        (lambda c, m: c.log("x", "high"), TypeError, r"Cohort.log: metric 'x' must be a number .* got str"),
        (lambda c, m: c.log("x", torch.ones(2)), ValueError, r"tensor of shape \[2\]"),
        (lambda c, m: c.log("x", 1.0, step=-1), ValueError, r"step=-1\): step must be an int >= 0"),
        (lambda c, m: c.log_dict([("x", 1.0)]), TypeError, "Cohort.log_dict takes a mapping"),
        (lambda c, m: m.log("x", [1.0]), TypeError, r"self.log: metric 'x' must be a number"),
        (lambda c, m: m.log("x", 1.0, sync_dist=True, reduce_fx="median"), ValueError, r"choose one of \['mean'"),
        (lambda c, m: m.log_dict({"x": 1.0}, colour="red"), TypeError, "colour"),
    ],
)
def test_bad_values_and_options_are_refused_on_every_rank(call, error, match):
    recorder = Recorder()
    cohort = _cohort(recorder)
    module = _train(cohort, 0)
    with pytest.raises(error, match=match):
        call(cohort, module)
    assert recorder.calls == []
