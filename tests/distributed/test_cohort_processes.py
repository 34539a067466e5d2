"""phalanx.Cohort on 2 CPU processes (gloo): the same hand-written loop as torch's DDP, the Trainer, and checkpoints
both ways."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script
from strategy_cases import case, promising

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

#: The strategies that promise a Cohort loop equal to the Trainer's (tests/strategy_cases.py): ddp in the ddp job, the
#: ones that start their own processes in the spawn job, each other one in a job of its own.
LAUNCHED = [row.name for row in promising("cohort") if row.launches]
SHARDED = [row.name for row in promising("cohort") if row.name != "ddp" and not row.launches]


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort_ddp")
    assert_ok(run_script("cohort_job.py", str(out), "ddp"))
    return out, json.loads((out / "ddp.json").read_text())


@pytest.mark.parametrize(
    "entry",
    [
        "cohort_equals_torch_ddp",  # bitwise: the Cohort loop ends where torch's DistributedDataParallel loop does
        "trainer_equals_cohort",  # Trainer.fit on 'ddp' with the same model, data and loss
        "training_step_equals_cohort",  # a TrainingModule's training_step run through DDP's forward
        "cohort_loaded_trainer_weights",  # Cohort.load reads a Trainer checkpoint
    ],
)
def test_cohort_on_ddp_matches(ddp_job, entry):
    _, result = ddp_job
    assert result["world_size"] == 2
    assert result[entry] is True


def test_trainer_resumes_a_cohort_checkpoint_and_configure_ddp_is_called_by_both(ddp_job):
    _, result = ddp_job
    assert result["trainer_resumed_global_step"] == 55  # 50 Cohort steps in the checkpoint, then 5 in the Trainer
    assert result["cohort_loaded_global_step"] == [50, 50]  # the state's plain entry and Cohort.global_step
    assert result["configure_ddp_calls"] == 2  # once in the Cohort, once in the Trainer


def test_collectives(ddp_job):
    _, result = ddp_job
    assert result["all_reduce_mean"] == 0.5
    assert result["all_gather"] == [0, 1]
    assert result["broadcast"] == "from 0"


def test_spawn_and_fork_launch_return_rank_zero_result_equal_to_torch_ddp(ddp_job):
    out, _ = ddp_job
    assert_ok(run_script("cohort_job.py", str(out), "spawn"))
    reference = torch.load(out / "torch_ddp.pt", weights_only=True)
    results = json.loads((out / "spawn.json").read_text())
    assert sorted(results) == sorted(LAUNCHED)
    for strategy in LAUNCHED:
        weights = [torch.tensor(values) for values in results[strategy]]
        assert all(torch.equal(a, b) for a, b in zip(weights, reference)), strategy


@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_strategies_match_the_trainer_and_ddp_and_the_trainer_resumes_their_checkpoint(ddp_job, strategy):
    if case(strategy).needs is not None:
        pytest.importorskip(case(strategy).needs)
    out, _ = ddp_job
    assert_ok(run_script("cohort_job.py", str(out), strategy))
    result = json.loads((out / f"{strategy}.json").read_text())
    assert result["max_difference_to_trainer"] == 0.0  # the Cohort loop and Trainer.fit on the same strategy
    assert (
        result["trainer_resumed_global_step"] == 52
    )  # the Trainer resumed the Cohort's (sharded) checkpoint at step 50
    ours = torch.load(out / f"{strategy}.pt", weights_only=True)
    reference = torch.load(out / "torch_ddp.pt", weights_only=True)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, reference))  # sharded reductions: rounding only


def test_the_custom_loop_example_trains_on_two_processes_and_saves_a_trainer_format_checkpoint(tmp_path):
    import csv
    import re
    import sys
    from pathlib import Path

    from phalanx_distributed import clean_environment, run

    example = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"
    ckpt = tmp_path / "last.ckpt"
    job = run(
        [
            *(sys.executable, str(example), "--strategy", "ddp", "--devices", "2", "--epochs", "3"),
            *("--ckpt", str(ckpt), "--accumulate", "2", "--logs", str(tmp_path / "logs")),
        ],
        env=clean_environment(),
        cwd=tmp_path,
        timeout=180,
    )
    assert_ok(job)
    losses = [float(value) for value in re.findall(r"epoch \d: loss ([0-9.]+) \(world size 2\)", job.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], job.stdout  # printed once (rank zero), and it learns
    assert "final loss" in job.stdout
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["epoch"] == 3 and checkpoint["cohort"]["objects"] == {"epoch": 3}
    assert checkpoint["global_step"] == 3 * 512 // (32 * 2) // 2  # 8 batches an epoch per rank, 2 per step
    assert set(checkpoint["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    with open(tmp_path / "logs" / "custom_loop" / "version_0" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))  # written once, by rank zero, when train() returned
    assert [row["step"] for row in rows] == ["4", "8", "12"]
    assert [float(row["train_loss"]) for row in rows] == pytest.approx(losses, abs=1e-4)
