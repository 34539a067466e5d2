"""The training callbacks of issue 38 on 2 processes (tests/callback_project.py as a script, all cases of a strategy in
one launch, so the file costs four launches):

- ddp: Timer (rank 0's clock decides; the stop and a resume in the middle of its time as Lightning's), LambdaCallback
  (the same hooks as Lightning's), BasePredictionWriter (each rank writes its own part, with the dataset indices, as
  Lightning's), ModelPruning (the same weights as Lightning's, layer by layer; a resume after an epoch exact);
- fsdp: Timer, LambdaCallback and BasePredictionWriter work; ModelPruning is refused when fit starts (the parameters are
  sharded DTensors);
- OnExceptionCheckpoint is refused at set-up, saying why (on ddp; the reason, several processes, is the strategy's
  process count, not its kind).
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
#: The cases each launch runs, in order; the one refused on purpose goes last, as its error ends the launch.
LAUNCHES = {
    ("phalanx", "ddp"): ["timer_short", "lambda", "writer_batch_and_epoch", "pruning_local", "exception"],
    ("lightning", "ddp"): ["timer_short", "lambda", "writer_batch_and_epoch", "pruning_local"],
    ("phalanx", "fsdp"): ["timer_short", "lambda", "writer_batch_and_epoch", "pruning_local"],
    # Resumed in the middle of each callback's work: the Timer after 4 of its 7 s, the pruning after its first epoch.
    ("phalanx", "ddp_resumed"): ["timer_short=step=4.ckpt", "pruning_local=epoch=0.ckpt"],
}
#: The cases refused on purpose, with what the error says.
REFUSED = {
    ("phalanx", "ddp", "exception"): "OnExceptionCheckpoint cannot run on 2 processes",
    ("phalanx", "fsdp", "pruning_local"): "ModelPruning cannot prune under FSDPStrategy: net.0.weight is a DTensor",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(framework, strategy) -> (job, {case: {rank: summary}}, root), each launch made once on first use."""
    done: dict[tuple, tuple] = {}

    def get(framework: str, strategy: str) -> tuple:
        key = (framework, strategy)
        if key not in done:
            if framework == "lightning":
                pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of these rows")
            root = tmp_path_factory.mktemp(f"{framework}_{strategy}")
            cases = LAUNCHES[key]
            if strategy == "ddp_resumed":
                _, _, first = get(framework, "ddp")
                cases = [
                    f"{case}={first / case / 'ckpt' / name}" for case, _, name in (c.partition("=") for c in cases)
                ]
            command = [
                sys.executable,
                str(SCRIPT),
                framework,
                strategy.removesuffix("_resumed"),
                "2",
                str(root),
                *cases,
            ]
            job = run(command, env=clean_environment(), timeout=400, cwd=root)
            summaries = {
                case.partition("=")[0]: {
                    int(p.stem.split("_")[1]): json.loads(p.read_text())
                    for p in (root / case.partition("=")[0]).glob("summary_*.json")
                }
                for case in cases
            }
            done[key] = (job, summaries, root)
        return done[key]

    return get


def _completed(runs, framework: str, strategy: str, case: str) -> tuple[dict, Path]:
    """``case``'s summaries by rank and folder, from a launch in which it ran to its end on both ranks."""
    job, summaries, root = runs(framework, strategy)
    if not any(key[:2] == (framework, strategy) for key in REFUSED):
        assert_ok(job)
    assert sorted(summaries[case]) == [0, 1], job.stderr[-3000:]
    return summaries[case], root / case


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in summary["weights"].items()}


def _same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6), name


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_timer_stops_both_ranks_after_lightnings_step(runs, strategy):
    ours, _ = _completed(runs, "phalanx", strategy, "timer_short")
    theirs, _ = _completed(runs, "lightning", "ddp", "timer_short")
    # 40 samples, 2 ranks, batches of 4: 5 steps an epoch; 7 s at one step a second stops inside the second epoch.
    assert ours[0]["global_step"] == ours[1]["global_step"] == theirs[0]["global_step"] == 7
    _same_weights(_weights(ours[0]), _weights(theirs[0]))


def test_a_ddp_timer_resumed_after_4_of_its_7_seconds_stops_where_the_whole_run_stopped(runs):
    whole, _ = _completed(runs, "phalanx", "ddp", "timer_short")
    resumed, _ = _completed(runs, "phalanx", "ddp_resumed", "timer_short")
    assert resumed[0]["global_step"] == resumed[1]["global_step"] == 7
    _same_weights(_weights(resumed[0]), _weights(whole[0]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lambda_hooks_run_as_often_as_lightnings(runs, strategy):
    ours, _ = _completed(runs, "phalanx", strategy, "lambda")
    theirs, _ = _completed(runs, "lightning", "ddp", "lambda")
    assert ours[0]["hooks"] == ours[1]["hooks"] == theirs[0]["hooks"]


def _predictions(folder: Path) -> dict[str, dict]:
    return {path.name: torch.load(path, weights_only=True) for path in (folder / "predictions").glob("*.pt")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_rank_writes_its_own_predictions_with_their_indices(runs, strategy):
    _, folder = _completed(runs, "phalanx", strategy, "writer_batch_and_epoch")
    written = _predictions(folder)
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
        _, their_folder = _completed(runs, "lightning", "ddp", "writer_batch_and_epoch")
        theirs = _predictions(their_folder)
        assert sorted(theirs) == sorted(written)
        for name, item in theirs.items():
            assert written[name]["indices"] == item["indices"], name


def test_ddp_pruning_matches_lightning_and_resumes_exactly(runs):
    ours, _ = _completed(runs, "phalanx", "ddp", "pruning_local")
    theirs, _ = _completed(runs, "lightning", "ddp", "pruning_local")
    _same_weights(_weights(ours[0]), _weights(theirs[0]))
    _same_weights(_weights(ours[1]), _weights(ours[0]))  # the ranks agree on the masks
    resumed, _ = _completed(runs, "phalanx", "ddp_resumed", "pruning_local")
    _same_weights(_weights(resumed[0]), _weights(ours[0]))


@pytest.mark.parametrize(("framework", "strategy", "case"), sorted(REFUSED))
def test_what_cannot_work_is_refused_before_training(runs, framework, strategy, case):
    job, summaries, root = runs(framework, strategy)
    assert job.returncode != 0 and REFUSED[framework, strategy, case] in job.stderr
    assert not summaries[case] and not list((root / case).rglob("*.ckpt"))
