"""The training callbacks of issue 38 on 2 processes (tests/callback_project.py as a script):

- ddp: Timer (rank 0's clock decides; the stop and a resume as Lightning's), LambdaCallback (the same hooks as
  Lightning's), BasePredictionWriter (each rank writes its own part, with the dataset indices, as Lightning's),
  ModelPruning (the same weights as Lightning's, layer by layer; a resume after an epoch exact);
- fsdp: Timer, LambdaCallback and BasePredictionWriter work; ModelPruning is refused when fit starts (the parameters are
  sharded DTensors);
- OnExceptionCheckpoint is refused at set-up on both, saying why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import callback_project as project
import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run

SCRIPT = Path(project.__file__)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(framework, strategy, case, resumed from) -> (job, {rank: summary}, root), each run once on first use."""
    done: dict[tuple, tuple] = {}

    def get(framework: str, strategy: str, case: str, ckpt: str = "") -> tuple:
        key = (framework, strategy, case, ckpt)
        if key not in done:
            if framework == "lightning":
                pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of these rows")
            root = tmp_path_factory.mktemp(f"{framework}_{strategy}_{case}")
            command = [
                sys.executable,
                str(SCRIPT),
                framework,
                strategy,
                "2",
                case,
                str(root),
                *([ckpt] if ckpt else []),
            ]
            job = run(command, env=clean_environment(), timeout=400, cwd=root)
            summaries = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in root.glob("summary_*.json")}
            done[key] = (job, summaries, root)
        return done[key]

    return get


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in summary["weights"].items()}


def _same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6), name


def test_ddp_timer_stops_both_ranks_after_lightnings_step_and_resumes(runs):
    job, ours, root = runs("phalanx", "ddp", "timer")
    assert_ok(job)
    their_job, theirs, _ = runs("lightning", "ddp", "timer")
    assert_ok(their_job)
    # 40 samples, 2 ranks, batches of 4: 5 steps an epoch; 17 s at one step a second.
    assert ours[0]["global_step"] == ours[1]["global_step"] == theirs[0]["global_step"] == 17
    _same_weights(_weights(ours[0]), _weights(theirs[0]))
    resumed_job, resumed, _ = runs("phalanx", "ddp", "timer", str(root / "ckpt" / "step=6.ckpt"))
    assert_ok(resumed_job)
    assert resumed[0]["global_step"] == resumed[1]["global_step"] == 17
    _same_weights(_weights(resumed[0]), _weights(ours[0]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lambda_hooks_run_as_often_as_lightnings(runs, strategy):
    job, ours, _ = runs("phalanx", strategy, "lambda")
    assert_ok(job)
    their_job, theirs, _ = runs("lightning", "ddp", "lambda")
    assert_ok(their_job)
    assert ours[0]["hooks"] == ours[1]["hooks"] == theirs[0]["hooks"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_rank_writes_its_own_predictions_with_their_indices(runs, strategy):
    job, _, root = runs("phalanx", strategy, "writer_batch_and_epoch")
    assert_ok(job)
    written = {path.name: torch.load(path, weights_only=True) for path in (root / "predictions").glob("*.pt")}
    indices = sorted(i for name, item in written.items() if name.startswith("batch_") for i in item["indices"])
    assert indices == list(range(18))  # every sample once, split between the two ranks
    data = project.data(18, seed=2).tensors[0]
    for rank in (0, 1):
        epoch = written[f"epoch_{rank}.pt"]
        (batches,) = epoch["indices"]
        for batch_indices, prediction in zip(batches, epoch["predictions"]):
            assert prediction.shape == (len(batch_indices), 1)
        assert sum(len(b) for b in batches) == 9 and data[batches[0]].shape == (len(batches[0]), 4)
    if strategy == "ddp":
        their_job, _, their_root = runs("lightning", "ddp", "writer_batch_and_epoch")
        assert_ok(their_job)
        theirs = {path.name: torch.load(path, weights_only=True) for path in (their_root / "predictions").glob("*.pt")}
        assert sorted(theirs) == sorted(written)
        for name, item in theirs.items():
            assert written[name]["indices"] == item["indices"], name


def test_ddp_pruning_matches_lightning_and_resumes_exactly(runs):
    job, ours, root = runs("phalanx", "ddp", "pruning_local")
    assert_ok(job)
    their_job, theirs, _ = runs("lightning", "ddp", "pruning_local")
    assert_ok(their_job)
    _same_weights(_weights(ours[0]), _weights(theirs[0]))
    _same_weights(_weights(ours[1]), _weights(ours[0]))  # the ranks agree on the masks
    resumed_job, resumed, _ = runs("phalanx", "ddp", "pruning_local", str(root / "ckpt" / "epoch=0.ckpt"))
    assert_ok(resumed_job)
    _same_weights(_weights(resumed[0]), _weights(ours[0]))


@pytest.mark.parametrize(
    ("strategy", "case", "message"),
    [
        ("fsdp", "pruning_local", "ModelPruning cannot prune under FSDPStrategy: net.0.weight is a DTensor"),
        ("ddp", "exception", "OnExceptionCheckpoint cannot run on 2 processes"),
        ("fsdp", "exception", "OnExceptionCheckpoint cannot run on 2 processes"),
    ],
)
def test_what_cannot_work_is_refused_before_training(runs, strategy, case, message):
    job, summaries, root = runs("phalanx", strategy, case)
    assert job.returncode != 0 and message in job.stderr
    assert not summaries and not list(root.rglob("*.ckpt"))


def test_fsdp_timer_stops_both_ranks_after_the_same_step(runs):
    job, ours, _ = runs("phalanx", "fsdp", "timer")
    assert_ok(job)
    assert ours[0]["global_step"] == ours[1]["global_step"] == 17
