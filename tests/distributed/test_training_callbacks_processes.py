"""The training callbacks on DDP (2 CPU processes, tests/distributed/scripts/training_callbacks_job.py): the
accumulation schedule and SWA (with its batch-norm epoch) keep both processes' parameters equal and count Lightning's
steps; BackboneFinetuning is refused at set-up, as DDP would not average the gradients of what it unfreezes."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("training_callbacks")
    assert_ok(run_script("training_callbacks_job.py", str(out), timeout=300))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


# 32 samples, 4 batches of 4 a process per epoch. Accumulation {1: 2}: 4 steps, then 2 per epoch. SWA from epoch 2 of
# 3: the epochs 2 and 3 averaged, then the batch-norm epoch, which counts one step.
@pytest.mark.parametrize(
    ("case", "steps", "epochs", "extra"),
    [("accumulation", 4 + 2 + 2, 3, {"accumulate_grad_batches": 2}), ("swa", 3 * 4 + 1, 4, {"n_averaged": 2})],
)
def test_both_processes_end_with_the_same_parameters_and_lightnings_steps(ranks, case, steps, epochs, extra):
    first, second = ranks[0][case], ranks[1][case]
    assert first["parameters"] == second["parameters"]
    assert (first["global_step"], first["current_epoch"]) == (second["global_step"], second["current_epoch"])
    assert (first["global_step"], first["current_epoch"]) == (steps, epochs)
    assert {key: first[key] for key in extra} == extra


def test_backbone_finetuning_is_refused_on_every_process(ranks):
    for rank in ranks:
        assert "would not average across them" in rank["finetuning"]["error"]
