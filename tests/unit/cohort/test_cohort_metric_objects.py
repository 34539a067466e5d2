"""torchmetrics objects in a Cohort's logging: ``cohort.log`` / ``log_dict`` and ``self.log`` / ``log_dict`` of a
module the Cohort set up write a Metric's ``compute()`` (what a Fabric user computes by hand before ``fabric.log``;
Fabric itself would hand the object to its loggers unchanged), a MetricCollection member by member under the names it
gives them; ``sync_dist`` does not apply to a Metric; the Metric is left as it is (a Cohort has no epochs: the loop
resets it); a Metric that gives no single number is refused before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchmetrics", reason="torchmetrics is not installed: nothing to log")

from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.classification import BinaryAccuracy, BinaryF1Score, MulticlassAccuracy  # noqa: E402
from torchmetrics.functional.classification import binary_accuracy, binary_f1_score  # noqa: E402

import phalanx  # noqa: E402
from phalanx.loggers import Logger  # noqa: E402


class Recorder(Logger):
    """Records log_metrics calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int | None]] = []

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


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.rand(6, generator=generator), (torch.rand(6, generator=generator) < 0.5).long()) for _ in range(count)
    ]


class Scored(phalanx.TrainingModule):
    """Logs a Metric (with sync_dist=True, which does not apply to it) and a MetricCollection in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.f1 = BinaryF1Score()
        self.scores = MetricCollection([BinaryF1Score(), BinaryAccuracy()], prefix="train_")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        score, target = batch
        self.f1(score, target)
        self.scores(score, target)
        self.log("f1", self.f1, sync_dist=True, on_step=True)
        self.log_dict(self.scores)
        return self.layer(score[:, None]).pow(2).mean()


def _cohort(recorder: Recorder) -> phalanx.Cohort:
    return phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1, loggers=recorder)


def test_self_log_of_a_metric_under_a_cohort_writes_its_compute_so_far():
    recorder, batches = Recorder(), _batches(3)
    cohort = _cohort(recorder)
    module = Scored()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for index, batch in enumerate(batches):
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    expected = []
    for seen in range(1, len(batches) + 1):
        score, target = (torch.cat(parts) for parts in zip(*batches[:seen]))
        f1, accuracy = float(binary_f1_score(score, target)), float(binary_accuracy(score, target))
        step = seen - 1
        expected += [({"f1": f1}, step), ({"train_BinaryF1Score": f1, "train_BinaryAccuracy": accuracy}, step)]
    assert recorder.calls == [(pytest.approx(metrics), step) for metrics, step in expected]
    assert module.f1._update_count == len(batches)  # not reset: the loop decides when its epoch ends


def test_cohort_log_and_log_dict_write_compute_of_metrics_and_collections():
    recorder, batches = Recorder(), _batches(2)
    f1 = BinaryF1Score()
    collection = MetricCollection({"acc": BinaryAccuracy(), "f1": BinaryF1Score()}, postfix="/val")
    for score, target in batches:
        f1.update(score, target)
        collection.update(score, target)
    score, target = (torch.cat(parts) for parts in zip(*batches))
    expected_f1, expected_acc = float(binary_f1_score(score, target)), float(binary_accuracy(score, target))

    def loop(cohort: phalanx.Cohort) -> None:
        cohort.log("f1", f1)
        cohort.log_dict(collection, step=5)
        cohort.log_dict({"f1": f1, "count": 2}, step=6)

    _cohort(recorder).launch(loop)
    assert recorder.calls == [
        ({"f1": pytest.approx(expected_f1)}, 0),
        ({"acc/val": pytest.approx(expected_acc), "f1/val": pytest.approx(expected_f1)}, 5),
        ({"f1": pytest.approx(expected_f1), "count": 2}, 6),
    ]


def _per_class() -> MulticlassAccuracy:
    metric = MulticlassAccuracy(num_classes=3, average=None)
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2]))
    return metric


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda c, m: c.log("c", MetricCollection([BinaryF1Score()])),
            TypeError,
            r"Cohort.log: metric 'c' is a MetricCollection; log it with log_dict\(collection\)",
        ),
        (
            lambda c, m: c.log("acc", _per_class()),
            ValueError,
            r"the compute\(\) of metric 'acc' gave a tensor of shape \[3\]; log a Metric that gives one number",
        ),
        (lambda c, m: m.log("acc", _per_class()), ValueError, r"self.log: the compute\(\) of metric 'acc' gave"),
        (lambda c, m: m.log("c", m.scores), TypeError, r"self.log: metric 'c' is a MetricCollection"),
    ],
)
def test_metric_objects_that_cannot_be_written_are_refused_before_any_write(call, error, match):
    recorder = Recorder()
    cohort = _cohort(recorder)
    module = Scored()
    cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(error, match=match):
        call(cohort, module)
    assert recorder.calls == []
