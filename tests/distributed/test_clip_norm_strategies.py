"""Clipping by total norm equals one process's on every CPU strategy, tensor parallelism's mixed DTensor/plain set
included (torch's clip_grad_norm_ refuses that set): same norm for norm_type 2 and inf, same clipped gradients, same
weights after the step. Job: scripts/clip_norm_job.py."""

from __future__ import annotations

import pytest
import torch
from phalanx_distributed import assert_ok, run_script
from strategy_cases import names

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

#: The strategies that promise it (tests/strategy_cases.py), against single_device's clipping.
PARALLEL = [name for name in names("clip_norm") if name != "single_device"]
TOLERANCE = dict(rtol=1e-4, atol=1e-6)  # what test_sharded.py allows tensor parallelism against one process


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip_norm")
    assert_ok(run_script("clip_norm_job.py", str(out), "single_device", timeout=120))
    assert_ok(run_script("clip_norm_job.py", str(out), *PARALLEL, timeout=300))
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in ["single_device", *PARALLEL]}


def test_the_tensor_parallel_plan_leaves_a_mixed_set_of_dtensor_and_plain_gradients(runs):
    assert runs["model_parallel"]["mixed"] is True
    assert runs["single_device"]["mixed"] is False


@pytest.mark.parametrize("strategy", PARALLEL)
@pytest.mark.parametrize("norm", ["norm_2", "norm_inf"])
def test_the_total_norm_equals_the_single_process_norm(runs, strategy, norm):
    reference = runs["single_device"][norm]
    assert reference > 0.05  # the step clips
    assert runs[strategy][norm] == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("strategy", PARALLEL)
@pytest.mark.parametrize("tensors", ["grads", "weights", "grads_inf"])
def test_clipped_gradients_and_the_weights_after_the_step_equal_the_single_process_ones(runs, strategy, tensors):
    ours, reference = runs[strategy][tensors], runs["single_device"][tensors]
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], **TOLERANCE)
