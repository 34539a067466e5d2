"""Resume anywhere: checkpoints written on 2 CPU processes as one file (ddp), a sharded FSDP directory and DeepSpeed
ZeRO-1 / ZeRO-2 / ZeRO-3 directories, and files written on 1 process (single device, and a ddp_ft replica group), resume
with ``ckpt_path=`` on 1 process (single device, one ddp_ft replica group) and on 2 processes (ddp, fsdp,
model_parallel, DeepSpeed stage 1, 2 and 3; hsdp_ft, one replica group of both, resumes fsdp's and its own resumes on
fsdp and one device), each ending where the target's uninterrupted run ends: weights, Adam's
moments and step, the global step, the samples seen and the loss at each step after the resume. Pipelines join on
their own cells: a checkpoint written under pipeline_parallel_size=2 resumes on one device, under ddp, fsdp and
model_parallel without a pipeline, and ddp, fsdp and one-process checkpoints, and a pipeline's with two stages per
rank, resume under pipeline_parallel_size=2 with one stage per rank; so does a pipeline's checkpoint found in the
run's checkpoint folder by ``ckpt_path="auto"``.

One 2-process launch (scripts/resume_matrix_job.py) writes the sources and runs every 2-process cell; the
one-process columns run in this process (ddp_ft's with a lighthouse here: a replica group is its own job, so one group
adds no launch; hsdp_ft's group is the job's 2 processes, with a lighthouse in rank 0's). Skipped when deepspeed or
torchft is not installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
pytest.importorskip("torchft")  # the ddp_ft rows

from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, run_script  # noqa: E402
from strategy_cases import promising  # noqa: E402

from phalanx.cli import main as phalanx_cli  # noqa: E402

sys.path.insert(0, str(SCRIPTS))

from resume_matrix_job import (  # noqa: E402
    CELLS,
    ONE_PROCESS_TARGETS,
    SAVE_AT,
    STEPS,
    TARGETS,
    MatrixMLP,
    run_one,
    write_one_process_sources,
)

# Observed: 2-process cells end bit-identical to their reference, single-device ones within 7e-8. Weights use
# test_sharded's tolerance (a strategy against one process); Adam's moments (exp_avg_sq is ~1e-5 here) a finer atol.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
MOMENT_TOLERANCE = dict(rtol=1e-4, atol=1e-7)
#: What each target runs as (tests/strategy_cases.py): the strategy class, and whether the module's parameters are
#: sharded DTensors. The job resumes on every 2-process row that promises 'resume'; 'single' is single_device's row,
#: 'ddp_ft' one replica group of ddp_ft, both in this process.
TARGET_KINDS = {
    ONE_PROCESS_TARGETS.get(row.name, row.name): (row.strategy_class, row.sharded) for row in promising("resume")
}
#: A pipeline of two stages on two processes (no data parallelism): each rank holds whole tensors of its stages.
PIPELINE_KINDS = {"pp": ("ModelParallelStrategy", False)}


def test_the_job_resumes_on_every_strategy_that_promises_it():
    assert sorted([*ONE_PROCESS_TARGETS.values(), *TARGETS]) == sorted(TARGET_KINDS)
    assert {target for _, target in CELLS} == {*TARGET_KINDS, *PIPELINE_KINDS}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume_matrix")
    write_one_process_sources(out)
    # A hang bound, not a speed claim: on a loaded 2-core machine the job took over 400 s before hsdp_ft's cells.
    assert_ok(run_script("resume_matrix_job.py", str(out), env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600))
    run_one(out)
    return out


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _assert_close(
    ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str, tolerance: dict = TOLERANCE
) -> None:
    assert ours.keys() == reference.keys(), what
    for name in reference:
        torch.testing.assert_close(ours[name].float(), reference[name].float(), **tolerance, msg=f"{what} {name}")


@pytest.mark.parametrize(("source", "target"), CELLS)
def test_a_checkpoint_resumes_on_every_strategy_like_the_uninterrupted_run(matrix: Path, source: str, target: str):
    error = matrix / f"{source}__{target}.error"
    assert not error.exists(), f"{source} -> {target}: {error.read_text() if error.exists() else ''}"
    resumed, reference = _load(matrix / f"{source}__{target}.pt"), _load(matrix / f"ref_{target}.pt")
    strategy, sharded = {**TARGET_KINDS, **PIPELINE_KINDS}[target]
    assert resumed["strategy"] == reference["strategy"] == strategy
    assert bool(resumed["dtensor_parameters"]) is sharded  # FSDP and ModelParallel really hold shards
    assert resumed["global_step"] == reference["global_step"] == STEPS
    assert resumed["engine_steps"] == reference["engine_steps"]  # DeepSpeed's engine counts on from the checkpoint
    assert resumed["adam_steps"] == reference["adam_steps"] == [float(STEPS)]  # the optimizer state went on
    # The data position continues: each rank sees exactly the batches the uninterrupted run saw after the save.
    assert len(resumed["seen"]) == len(reference["seen"])
    for rank, seen in enumerate(resumed["seen"]):
        assert seen == reference["seen"][rank][SAVE_AT:], f"rank {rank}"
    assert resumed["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5, abs=1e-7)  # the loss curve
    _assert_close(resumed["weights"], reference["weights"], "weight")
    for key in ("exp_avg", "exp_avg_sq"):
        _assert_close(
            {name: moments[key] for name, moments in resumed["moments"].items()},
            {name: moments[key] for name, moments in reference["moments"].items()},
            key,
            MOMENT_TOLERANCE,
        )


@pytest.mark.parametrize("source", ["ds1", "ds2", "ds3"])
def test_consolidate_turns_a_two_process_deepspeed_directory_into_one_file(
    matrix: Path, source: str, tmp_path: Path
) -> None:
    output = tmp_path / "whole.ckpt"
    assert phalanx_cli(["checkpoint", "consolidate", str(matrix / f"src_{source}.ckpt"), str(output)]) == 0
    checkpoint = torch.load(output, weights_only=True)
    model = MatrixMLP()
    model.load_state_dict(checkpoint["state_dict"])  # strict: every tensor of the single-device model is there
    saved = _load(matrix / f"src_{source}.pt")
    _assert_close(dict(model.named_parameters()), saved["weights"], "consolidated weight")
    assert checkpoint["global_step"] == SAVE_AT
    # DeepSpeed's engine counters (what a DeepSpeed run resumed from the file counts on from): updates, samples.
    assert checkpoint["deepspeed_engine_steps"] == {"global_steps": SAVE_AT, "global_samples": SAVE_AT * 8}
    names = [name for name, _ in model.named_parameters()]
    state = checkpoint["optimizer_states"][0]["state"]
    _assert_close({name: state[i]["exp_avg"] for i, name in enumerate(names)},
                  {name: saved["moments"][name]["exp_avg"] for name in names}, "consolidated exp_avg")  # fmt: skip
