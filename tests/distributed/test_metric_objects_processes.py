"""torchmetrics objects in ``self.log`` / ``self.log_dict`` on 2 processes (tests/metric_logging_project.py, case
"distributed": a Metric on_step and on_epoch, Metrics and a MetricCollection on two validation dataloaders, a
MeanMetric with sync_dist=True, SumMetrics, the test stage).

- ddp: rank 0's CSV points, the Trainer's metric dictionaries and the test results are Lightning 2.6's on ddp.
- every strategy (ddp, fsdp, model_parallel, deepspeed_stage_2, ddp_spawn): each epoch value is compute() over the
  whole epoch's data of both processes (torchmetrics gathers the states), not rank 0's, nor a mean of batch values;
  the strategies that shard the data the way ddp does write Lightning's CSV points too.
- ddp_spawn: the values reach the main process, and the SumMetrics are right: the workers own their Metric states
  (torch.multiprocessing hands the module's tensors over in shared memory, where both workers would add up).
- a Cohort on ddp: ``self.log`` of a Metric writes its compute() so far, over both processes; ``cohort.log`` and
  ``cohort.log_dict`` the same at the end.

model_parallel runs with its default mesh (tensor parallel 2): both processes read every batch, so a Metric gathers
each sample twice: ratios are unchanged, sums double (as in Lightning); its sums are not checked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from phalanx_distributed import assert_ok, clean_environment, run

pytest.importorskip("torchmetrics", reason="torchmetrics is not installed: nothing to log")

import metric_logging_project as project  # noqa: E402
from torchmetrics.functional.classification import (  # noqa: E402
    binary_f1_score,
    multiclass_accuracy,
    multiclass_f1_score,
)

SCRIPT = Path(project.__file__)
STRATEGIES = ["ddp", "fsdp", "model_parallel", "deepspeed_stage_2", "ddp_spawn"]
#: Strategies whose processes read different halves of the data, as Lightning's ddp does.
SHARDED = {"ddp", "fsdp", "deepspeed_stage_2", "ddp_spawn"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(framework, strategy) -> rank 0's summary (with "stderr": the job's), each run once on first use."""
    done: dict[tuple[str, str], dict] = {}

    def get(framework: str, strategy: str) -> dict:
        if (framework, strategy) not in done:
            if framework == "lightning":
                try:
                    import pytorch_lightning  # noqa: F401
                except ImportError:
                    pytest.skip("pytorch-lightning is not installed: the equivalence rows run it as the oracle")
            out = tmp_path_factory.mktemp(f"{framework}_{strategy}")
            command = [
                sys.executable,
                str(SCRIPT),
                framework,
                strategy,
                "2",
                framework if framework == "cohort" else "distributed",
                str(out),
            ]
            job = run(command, env=clean_environment(DS_ACCELERATOR="cpu"), timeout=500, cwd=out)
            assert_ok(job)
            done[(framework, strategy)] = {**json.loads((out / "summary.json").read_text()), "stderr": job.stderr}
        return done[(framework, strategy)]

    return get


def _close(ours, theirs, where: str) -> None:
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs), where
        for key in theirs:
            _close(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), where
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            _close(mine, other, f"{where}[{index}]")
    elif isinstance(theirs, float):
        assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-6), (where, ours, theirs)
    else:
        assert ours == theirs, where


def test_ddp_logs_metric_objects_as_lightning_does(runs):
    ours, theirs = runs("phalanx", "ddp"), runs("lightning", "ddp")
    assert {name for name, _, _ in ours["points"]} > {"train_f1_step", "train_f1_epoch", "val_f1/dataloader_idx_1"}
    for key in ("fit", "test", "test_callback", "points"):
        _close(ours[key], theirs[key], key)


def test_no_sync_dist_warning_for_a_metric_object(runs):
    # A Metric logged without sync_dist=True is synchronised by torchmetrics: the warning for plain values is not due.
    assert "without sync_dist=True" not in runs("phalanx", "ddp")["stderr"]


def _references(strategy: str) -> dict[str, float]:
    """Every epoch value the case logs, computed by torchmetrics over the whole stage's data at once."""
    train, tests = project.train_data().tensors, project.testing_data().tensors
    expected = {
        "train_f1_epoch": binary_f1_score(train[2], train[3]),
        "train_sum": train[2].sum(),
        "test_f1": binary_f1_score(tests[2], tests[3]),
        "test_acc_epoch": multiclass_accuracy(tests[4], tests[5], num_classes=project.CLASSES),
    }
    for index in range(2):
        _, _, score, target, logits, classes = project.val_data(index).tensors
        suffix = f"/dataloader_idx_{index}"
        expected[f"val_f1{suffix}"] = binary_f1_score(score, target)
        expected[f"val_mean{suffix}"] = score.mean()
        expected[f"val_sum{suffix}"] = score.sum()
        expected[f"val_MulticlassAccuracy{suffix}"] = multiclass_accuracy(logits, classes, num_classes=project.CLASSES)
        expected[f"val_MulticlassF1Score{suffix}"] = multiclass_f1_score(logits, classes, num_classes=project.CLASSES)
    if strategy == "model_parallel":
        expected = {name: value for name, value in expected.items() if "_sum" not in name}
    return {name: float(value) for name, value in expected.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_epoch_values_are_compute_over_both_processes_data(runs, strategy):
    summary = runs("phalanx", strategy)
    seen = {**summary["fit"]["callback"], **summary["test_callback"]}
    written: dict[str, list[float]] = {}
    for name, _, value in summary["points"]:
        written.setdefault(name, []).append(value)
    for name, expected in _references(strategy).items():
        assert seen[name] == pytest.approx(expected, rel=1e-5), name
        # Every epoch's value, the first included (under ddp_spawn its Metrics start in the memory the workers share).
        epochs = 1 if name.startswith("test_") else project.EPOCHS
        assert written[name] == pytest.approx([expected] * epochs, rel=1e-5), name
    if strategy != "ddp_spawn":  # the main process's copy of the module was never trained
        assert summary["fit"]["updated"] == [], "a logged Metric was not reset at the end of its epoch or stage"


@pytest.mark.parametrize("strategy", sorted(SHARDED - {"ddp"}))
def test_sharded_strategies_write_lightning_s_points(runs, strategy):
    _close(runs("phalanx", strategy)["points"], runs("lightning", "ddp")["points"], "points")


def test_a_cohort_writes_compute_of_metrics_over_both_processes(runs):
    points = runs("cohort", "ddp")["points"]
    train = project.train_data().tensors
    f1 = float(binary_f1_score(train[2], train[3]))
    accuracy = float(multiclass_accuracy(train[4], train[5], num_classes=project.CLASSES))
    steps = math.ceil(project.TRAIN / 2 / project.BATCH)  # each process's batches
    last = {name: value for name, step, value in points if step == steps - 1}
    assert last["train_f1"] == pytest.approx(f1) and last["train_sum"] == pytest.approx(float(train[2].sum()))
    assert last["train_MulticlassAccuracy"] == pytest.approx(accuracy)
    at_end = {name: value for name, step, value in points if step == steps}
    assert at_end == pytest.approx({"epoch_f1": f1, "train_MulticlassAccuracy": accuracy, **_f1_macro(train)})
    first = [value for name, step, value in points if name == "train_sum" and step == 0]
    # Each process's first batch takes every other sample: together, the first 2 * BATCH (gathered at every write).
    assert first == pytest.approx([float(train[2][: 2 * project.BATCH].sum())])


def _f1_macro(train) -> dict[str, float]:
    return {"train_MulticlassF1Score": float(multiclass_f1_score(train[4], train[5], num_classes=project.CLASSES))}
