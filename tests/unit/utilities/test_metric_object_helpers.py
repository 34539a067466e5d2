"""phalanx.utilities.metric_objects: torchmetrics objects recognised without importing torchmetrics, a
MetricCollection's names for log_dict, and Metric states made private to a spawned worker (they arrive in the memory
that the parent and every worker share, as torch.multiprocessing hands tensors over)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchmetrics", reason="torchmetrics is not installed")

from torchmetrics import CatMetric, MeanMetric, MetricCollection, SumMetric  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score  # noqa: E402

from phalanx.utilities.metric_objects import (  # noqa: E402
    is_metric,
    is_metric_collection,
    loggable_items,
    own_metric_states,
)


@pytest.mark.parametrize(
    ("value", "metric", "collection"),
    [
        (SumMetric(), True, False),
        (MetricCollection([SumMetric()]), False, True),
        (torch.tensor(1.0), False, False),
        (nn.Linear(1, 1), False, False),
        ({"a": SumMetric()}, False, False),
    ],
    ids=["metric", "collection", "tensor", "module", "dict"],
)
def test_metric_objects_are_told_apart(value, metric, collection):
    assert (is_metric(value), is_metric_collection(value)) == (metric, collection)


def test_without_torchmetrics_imported_nothing_is_a_metric_and_nothing_imports_it():
    code = (
        "import sys\n"
        "from phalanx.utilities.metric_objects import is_metric, is_metric_collection\n"
        "print(is_metric(1.0), is_metric_collection({}), 'torchmetrics' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False", "False"], done.stderr[-2000:]


@pytest.mark.parametrize("compute_groups", [True, False])
def test_a_collection_logs_its_members_under_their_prefixed_names(compute_groups):
    collection = MetricCollection(
        [MulticlassAccuracy(num_classes=3), MulticlassF1Score(num_classes=3)],
        prefix="val_",
        postfix="_x",
        compute_groups=compute_groups,
    )
    collection.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
    items = loggable_items(collection)
    assert sorted(items) == ["val_MulticlassAccuracy_x", "val_MulticlassF1Score_x"]
    # The members compute what the collection computes (with compute groups they share one state, not copies of it).
    assert {name: float(metric.compute()) for name, metric in items.items()} == pytest.approx(
        {name: float(value) for name, value in collection.compute().items()}
    )
    assert loggable_items({"a": 1}) == {"a": 1}
    with pytest.raises(TypeError, match="got list"):
        loggable_items([1])


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.total = SumMetric()
        self.mean = MeanMetric()
        self.seen = CatMetric()
        self.seen.update(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("shared", [True, False])
def test_a_spawned_worker_gets_its_own_metric_states(shared):
    holder = Holder()
    states = [holder.total.sum_value, holder.mean.mean_value, holder.mean.weight, *holder.seen.value]
    if shared:
        for tensor in states:
            tensor.share_memory_()
    own_metric_states(holder)
    after = [holder.total.sum_value, holder.mean.mean_value, holder.mean.weight, *holder.seen.value]
    assert not any(tensor.is_shared() for tensor in after)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(after, states))
    # States that were private already are kept as they are (no copy).
    assert all((mine is theirs) != shared for mine, theirs in zip(after, states))
    holder.total.update(torch.tensor(5.0))
    assert float(states[0]) == 0.0 if shared else float(states[0]) == 5.0
