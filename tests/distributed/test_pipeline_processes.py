"""Pipeline parallelism on 2 CPU processes (pipeline_parallel_size=2, gloo) against one process on the same batches:
1F1B with the Trainer's defaults, GPipe with clipping by norm and accumulation, every virtual-stage schedule
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), the docs' example, and a sharded
checkpoint that resumes on one process under other strategies; one launched job runs every case
(``scripts/pipeline_job.py``), one process runs them here."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, run_script

sys.path.insert(0, str(SCRIPTS))

from pipeline_common import CASES, TOLERANCE, fit_for_checkpoint, loader, run_case  # noqa: E402

from phalanx.cli import main as cli  # noqa: E402
from phalanx.strategies import ModelParallelStrategy  # noqa: E402
from phalanx.strategies.pipeline import SCHEDULES, V_SCHEDULES  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    assert_ok(run_script("pipeline_job.py", str(out), timeout=600))
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_one")
    found = {}
    for name in CASES:
        trainer, module = run_case(name, "auto", 1, str(root / name))
        predictions = torch.cat(trainer.predict(module, loader())) if name == "defaults_1F1B" else None
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        found[name] = (module.losses, metrics, module.state_dict(), predictions, module.hooks, module.validation_losses)
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_two_stages_train_like_one_process(job, one_process, name):
    out, results = job
    losses, metrics, weights, *_ = one_process[name]
    result, rel = results[name], TOLERANCE.get(name, 1e-5)
    # The loss reaches every rank (broadcast from the last stage): each rank logs one process's losses.
    for rank_losses, rank_metrics in zip(result["losses"], result["metrics"]):
        assert rank_losses == pytest.approx(losses, rel=rel, abs=1e-6)
        assert rank_metrics.keys() == metrics.keys() and "val_loss" in metrics
        assert rank_metrics == pytest.approx(metrics, rel=rel, abs=1e-6)
    gathered = torch.load(out / f"{name}.pt", weights_only=True)
    assert gathered.keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(gathered[key], value, rtol=rel, atol=rel / 10, msg=lambda m, key=key: f"{key}: {m}")
    # Each rank holds only its stage's parameters: the two together are the whole model, each byte once.
    whole = sum(value.numel() * value.element_size() for value in weights.values())
    schedule = CASES[name][0]
    looped, v_shaped = SCHEDULES[schedule][1], schedule in V_SCHEDULES
    assert result["stages"] == ([[0, 3], [1, 2]] if v_shaped else [[0, 2], [1, 3]] if looped else [[0], [1]])
    assert sum(result["bytes"]) == whole and all(0 < part < whole for part in result["bytes"])


@pytest.mark.parametrize(
    ("hook", "receives"),
    [
        # The schedule runs forward and backward in one call: the loss reaches on_before_backward after it, with the
        # gradients of this batch already there (one process: not yet), divided by accumulate_grad_batches as usual.
        ("on_before_backward", "the loss, after the backward"),
        # Each rank sees its own stages' gradients: their squared norms add up to one process's.
        ("on_after_backward", "this rank's gradients"),
        ("on_before_optimizer_step", "this rank's gradients"),
    ],
)
def test_the_hooks_receive_one_process_values_at_the_same_calls(job, one_process, hook, receives):
    _, results = job
    for name in CASES:
        single = [call for call in one_process[name][4] if call[0] == hook]
        ranks = [[call for call in calls if call[0] == hook] for calls in results[name]["hooks"]]
        assert single and all(len(calls) == len(single) for calls in ranks), name
        after = [call[2] for call in one_process[name][4] if call[0] == "on_after_backward"]
        rel = TOLERANCE.get(name, 1e-5)
        for index, (_, loss, squared) in enumerate(single):
            if receives == "the loss, after the backward":
                assert all(calls[index][1] == pytest.approx(loss, rel=rel) for calls in ranks), name
                squared = after[index]  # the gradients that one process has only after its backward
            total = sum(calls[index][2] or 0.0 for calls in ranks)
            assert total == pytest.approx(squared, rel=10 * rel), (name, index)


def test_prediction_runs_forward_through_the_pipeline(job, one_process):
    out, _ = job
    expected = one_process["defaults_1F1B"][3]
    torch.testing.assert_close(torch.load(out / "defaults_1F1B_predictions.pt", weights_only=True), expected)


def test_defaults_log_and_checkpoint_the_whole_model(job, one_process):
    import torch.distributed.checkpoint as dcp

    out, results = job
    result = results["defaults_1F1B"]
    log_dir = result["log_dir"]
    # The Trainer's defaults were on: CSV logger, progress bar, checkpoints in the log folder, a 2-batch sanity check.
    assert result["defaults"] == ["CSVLogger", "TQDMProgressBar", f"{log_dir}/checkpoints", 2]
    # The sanity check ran through the pipeline forward on both ranks: one process's two losses, before training.
    single = one_process["defaults_1F1B"][5]
    assert [call[0] for call in single] == [True, True, False, False]
    for calls in result["validation"]:
        assert [call[0] for call in calls] == [call[0] for call in single]
        assert [call[1] for call in calls] == pytest.approx([call[1] for call in single], rel=1e-5)
    rows = list(csv.DictReader(open(f"{log_dir}/metrics.csv")))
    val = [float(row["val_loss"]) for row in rows if row.get("val_loss")]
    assert val == pytest.approx([one_process["defaults_1F1B"][1]["val_loss"]], rel=1e-5)
    (checkpoint,) = (out / "defaults_1F1B").rglob("*.ckpt")
    assert checkpoint.parent == Path(log_dir) / "checkpoints"  # the default folder, under the logger's version
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    # Both stages wrote their parameters, under the whole model's names.
    assert {f"model/{key}" for key in one_process["defaults_1F1B"][2]} <= set(saved)


def test_the_docs_example_trains_in_two_stages(job):
    # Its own asserts ran in the job (each rank holds its stage's parts, the loss falls); here: it ran to the end.
    _, results = job
    losses = results["docs_example"]
    assert len(losses) == 8 and losses[-1] < losses[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two epochs of ``AdamNet`` on one process, without a break: what every resumed run must reproduce."""
    trainer, module = fit_for_checkpoint("auto", 1, str(tmp_path_factory.mktemp("whole")), epochs=2)
    return module.losses, module.state_dict(), trainer.optimizers[0].state_dict()


def test_the_pipeline_checkpoint_keys_optimizer_state_by_parameter_name(job, uninterrupted):
    import torch.distributed.checkpoint as dcp

    out, _ = job
    saved = dcp.FileSystemReader(str(out / "pipeline.ckpt")).read_metadata().state_dict_metadata
    names = uninterrupted[1].keys()
    # Both stages' AdamW moments, under the whole model's names (positions would collide between the stages).
    assert {key for key in saved if key.startswith("optimizer/")} == {
        f"optimizer/0/{name}/{entry}" for name in names for entry in ("step", "exp_avg", "exp_avg_sq")
    }


@pytest.mark.parametrize("target", ["single_device", "model_parallel", "consolidated"])
def test_the_pipeline_checkpoint_resumes_exactly_elsewhere(job, uninterrupted, target, tmp_path):
    out, _ = job
    path = out / "pipeline.ckpt"
    if target == "consolidated":
        assert cli(["checkpoint", "consolidate", str(path), str(tmp_path / "whole.ckpt")]) == 0
        path = tmp_path / "whole.ckpt"
        whole = torch.load(path, weights_only=True)
        assert whole["state_dict"].keys() == uninterrupted[1].keys() and whole["global_step"] == 2
    strategy = ModelParallelStrategy() if target == "model_parallel" else "auto"
    try:
        trainer, module = fit_for_checkpoint(strategy, 1, str(tmp_path), epochs=2, ckpt_path=str(path))
    finally:
        if torch.distributed.is_initialized():  # model_parallel's group of one stays until exit otherwise
            torch.distributed.destroy_process_group()
    losses, weights, optimizer_state = uninterrupted
    # Weights, AdamW's moments and step, and the loop's step all came back: the second epoch is the unbroken run's.
    assert trainer.global_step == 4
    assert module.losses == pytest.approx(losses[2:], rel=1e-5, abs=1e-6)
    for key, value in weights.items():
        torch.testing.assert_close(
            module.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )
    resumed = trainer.optimizers[0].state_dict()
    assert resumed["state"].keys() == optimizer_state["state"].keys()
    for pid, entries in optimizer_state["state"].items():
        for entry, value in entries.items():
            torch.testing.assert_close(resumed["state"][pid][entry], value, rtol=1e-5, atol=1e-6)
