"""torchmetrics objects in ``self.log`` / ``self.log_dict`` under the Trainer (one device), against Lightning 2.6.

The same module (tests/metric_logging_project.py) runs under both: for every way of logging a ``Metric`` or a
``MetricCollection`` (on_step/on_epoch, epoch-end hooks, two dataloaders, one Metric under two names, a Metric only
updated), with the Trainer's defaults on and off, the CSV logger's names, steps and values and the Trainer's metric
dictionaries must be Lightning's, and every Metric must end the run reset. Also: an epoch value is compute() over the
epoch's data (not a mean of batch values), wrong uses are refused, logging a Metric adds no host-device sync to a step,
and phalanx never imports torchmetrics itself.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("torchmetrics", reason="torchmetrics is not installed: nothing to log")

import metric_logging_project as project  # noqa: E402
from phalanx_testing import quiet_trainer  # noqa: E402
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.classification import BinaryF1Score, MulticlassAccuracy  # noqa: E402
from torchmetrics.functional.classification import binary_f1_score  # noqa: E402

import phalanx  # noqa: E402
from phalanx.testing.step_counts import StepCountCallback, StepWindow  # noqa: E402
from phalanx.utilities.exceptions import MisconfigurationError  # noqa: E402


def _need_lightning() -> None:
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError:
        pytest.skip("pytorch-lightning is not installed: the Lightning-equivalence table runs it as the oracle")


def _assert_close(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs), where
        for key in theirs:
            _assert_close(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), where
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            _assert_close(mine, other, f"{where}[{index}]")
    elif isinstance(theirs, float):
        assert math.isclose(ours, theirs, rel_tol=1e-6, abs_tol=1e-7), (where, ours, theirs)
    else:
        assert ours == theirs, where


#: Every case on the quiet Trainer; three again with the Trainer's defaults on (sanity check, progress bar,
#: checkpointing, phalanx's default CSV logger).
EQUIVALENCE = [(case, False) for case in project.CASES if case != "cohort"]
EQUIVALENCE += [(case, True) for case in ("val_epoch", "train_both")]


@pytest.mark.parametrize(
    ("case", "defaults"), EQUIVALENCE, ids=[f"{c}-{'defaults' if d else 'quiet'}" for c, d in EQUIVALENCE]
)
def test_metric_objects_are_logged_as_lightning_logs_them(case, defaults, tmp_path):
    _need_lightning()
    theirs = project.run("lightning", case, tmp_path / "lightning", defaults=defaults)
    ours = project.run("phalanx", case, tmp_path / "phalanx", defaults=defaults)
    assert {name for name, _, _ in ours["points"]} - {"epoch"}, "the case logged nothing"
    for key in ("fit", "test", "test_callback", "points"):
        _assert_close(ours[key], theirs[key], key)
    assert ours["fit"]["updated"] == [], "a logged Metric was not reset at the end of its epoch or stage"


def _values(points: list, name: str) -> list[float]:
    return [value for point, _, value in points if point == name]


def test_an_epoch_value_is_compute_over_the_epoch_not_a_mean_of_its_batches(tmp_path):
    summary = project.run("phalanx", "train_both", tmp_path)
    _, _, score, target, _, _ = project.train_data().tensors
    expected = float(binary_f1_score(score, target))
    batches = math.ceil(project.TRAIN / project.BATCH)
    batch_values = _values(summary["points"], "train_f1_step")[:batches]
    sizes = [min(project.BATCH, project.TRAIN - start) for start in range(0, project.TRAIN, project.BATCH)]
    weighted_mean = sum(value * size for value, size in zip(batch_values, sizes)) / project.TRAIN
    assert _values(summary["points"], "train_f1_epoch") == pytest.approx([expected] * project.EPOCHS)
    assert summary["fit"]["callback"]["train_f1"] == pytest.approx(expected)
    assert abs(weighted_mean - expected) > 1e-3  # what logging the forward value on_epoch would have given


@pytest.mark.parametrize(("case", "name", "data"), [("val_epoch", "val_f1", "val"), ("test", "test_f1", "test")])
def test_evaluation_epoch_values_are_compute_over_the_whole_stage(case, name, data, tmp_path):
    summary = project.run("phalanx", case, tmp_path)
    dataset = project.val_data(0) if data == "val" else project.testing_data()
    _, _, score, target, _, _ = dataset.tensors
    expected = float(binary_f1_score(score, target))
    assert _values(summary["points"], name) == pytest.approx([expected] * (project.EPOCHS if data == "val" else 1))


# ------------------------------------------------------------------ wrong uses


class Misuse(phalanx.TrainingModule):
    """Runs ``action(self)`` in its first validation step."""

    def __init__(self, action: Callable[[Misuse], Any]) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.f1 = BinaryF1Score()
        self.per_class = MulticlassAccuracy(num_classes=3, average=None)
        self.collection = MetricCollection([BinaryF1Score()])
        self.action = action

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.f1(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
        self.per_class(torch.tensor([0, 1]), torch.tensor([0, 2]))
        self.collection(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
        self.action(self)


MISUSES = [
    (
        "a Metric that is no attribute",
        lambda m: m.log("f1", _updated(BinaryF1Score())),
        MisconfigurationError,
        r"self.log\('f1', <BinaryF1Score>\) logs a torchmetrics Metric that is not an attribute of Misuse.*"
        r"metric_attribute= .*\(collection.BinaryF1Score, f1, per_class\)",
    ),
    (
        "on_step and on_epoch both off",
        lambda m: m.log("f1", m.f1, on_step=False, on_epoch=False),
        ValueError,
        "on_step=False and on_epoch=False would record nothing",
    ),
    ("a MetricCollection in self.log", lambda m: m.log("c", m.collection), TypeError, r"self.log_dict\(collection\)"),
    (
        "a Metric that is no scalar",
        lambda m: m.log("per_class", m.per_class),
        ValueError,
        r"compute\(\) value is a tensor of shape \(3,\), but a logged Metric must give one number",
    ),
    (
        "a tensor, then a Metric, under one name",
        lambda m: (m.log("f1", torch.tensor(1.0)), m.log("f1", m.f1)),
        TypeError,
        "got a torchmetrics Metric and plain values for one name",
    ),
    (
        "a Metric, then a number, under one name",
        lambda m: (m.log("f1", m.f1), m.log("f1", 1.0)),
        TypeError,
        "got a torchmetrics Metric and plain values for one name",
    ),
    ("an unknown reduce_fx", lambda m: m.log("f1", m.f1, reduce_fx="median"), ValueError, "choose one of"),
    ("log_dict of a list", lambda m: m.log_dict([m.f1]), TypeError, "or a torchmetrics MetricCollection, got list"),
    ("an object", lambda m: m.log("x", object()), TypeError, "log a number, a one-element tensor or a torchmetrics"),
]


def _updated(metric: Any) -> Any:
    metric.update(torch.tensor([0.9]), torch.tensor([1]))
    return metric


@pytest.mark.parametrize(("action", "error", "match"), [row[1:] for row in MISUSES], ids=[row[0] for row in MISUSES])
def test_wrong_uses_of_a_metric_object_are_refused_with_the_way_out(action, error, match):
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    with pytest.raises(error, match=match):
        quiet_trainer().validate(Misuse(action), data)


class Unattached(phalanx.TrainingModule):
    """Keeps its Metric outside the module tree and names it with metric_attribute (Lightning accepts that)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.kept = {"f1": BinaryF1Score()}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        score, target = batch
        self.kept["f1"](score, target)
        self.log("val_f1", self.kept["f1"], metric_attribute="kept_f1")


def test_metric_attribute_names_a_metric_the_module_does_not_hold():
    score, target = torch.rand(12), (torch.rand(12) < 0.5).long()
    results = quiet_trainer().validate(Unattached(), DataLoader(TensorDataset(score, target), batch_size=5))
    assert results == [{"val_f1": pytest.approx(float(binary_f1_score(score, target)))}]


# ------------------------------------------------------------------ a lean step


class CountedMetric(phalanx.TrainingModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.f1 = BinaryF1Score(validate_args=False)
        self.mode = mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, target = batch
        self.f1(torch.sigmoid(x[:, 0]), target)  # the user's own metric work, the same in every mode
        if self.mode != "none":
            self.log("f1", self.f1, on_step=self.mode == "step", on_epoch=True, prog_bar=self.mode == "step")
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _syncs(mode: str, tmp_path: Path) -> float:
    window = StepWindow(warmup=2, steps=3)
    data = TensorDataset(torch.randn(64, 4), (torch.rand(64) < 0.5).long())
    trainer = quiet_trainer(
        default_root_dir=tmp_path / mode,
        logger=phalanx.loggers.CSVLogger(tmp_path / mode),
        log_every_n_steps=1000,
        callbacks=[StepCountCallback(window)],
        max_steps=window.total_steps,
    )
    trainer.fit(CountedMetric(mode), DataLoader(data, batch_size=4))
    return window.result().syncs


@pytest.mark.parametrize("mode", ["epoch", "step"])
def test_logging_a_metric_adds_no_host_device_sync_to_a_step(mode, tmp_path):
    assert _syncs(mode, tmp_path) == _syncs("none", tmp_path)


def test_phalanx_does_not_import_torchmetrics(tmp_path):
    code = (
        "import sys, torch, phalanx\n"
        "from phalanx_testing import Regressor, loaders, quiet_trainer\n"
        f"trainer = quiet_trainer(max_epochs=1, logger=phalanx.loggers.CSVLogger({str(tmp_path)!r}))\n"
        "trainer.fit(Regressor(), *loaders())\n"
        "print('torchmetrics' in sys.modules, trainer.callback_metrics['val_loss'] > 0)\n"
    )
    tests = Path(__file__).parents[3]
    env = dict(os.environ, PYTHONPATH=f"{tests}{os.pathsep}{tests.parent}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "tensor(True)"]
