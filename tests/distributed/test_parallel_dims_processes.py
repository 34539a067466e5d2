"""Layouts described by ParallelDims on 4 CPU processes: hybrid sharding on 2 x 2 (the case where neither axis has
size 1) and ModelParallel on 2 x 2 train like one process on the same 16 samples a step."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, run_script

sys.path.insert(0, str(SCRIPTS))

import phalanx  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

STEPS = 5  # as in scripts/parallel_dims_job.py


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel_dims")
    assert_ok(run_script("parallel_dims_job.py", str(out), timeout=600))
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process():
    from sharded_common import MLP, loader, quiet

    phalanx.seed_everything(7)
    module = MLP()
    quiet(max_steps=STEPS).fit(module, loader(1))
    return module.losses, module.state_dict()


@pytest.mark.parametrize(
    ("name", "mesh", "samplers"),
    [
        ("hsdp", [["replicate", "shard"], [2, 2]], [[4, r] for r in range(4)]),
        ("model_parallel", [["data_parallel", "tensor_parallel"], [2, 2]], [[2, 0], [2, 0], [2, 1], [2, 1]]),
    ],
)
def test_a_2x2_layout_trains_like_one_process(job, one_process, name, mesh, samplers):
    out, results = job
    single_losses, single_weights = one_process
    result = results[name]
    assert result["mesh"] == mesh
    assert [[s["num_replicas"], s["rank"]] for s in result["sampler"]] == samplers
    # Each rank's loss is the mean over its replica's samples; the replicas' mean is one process's 16-sample loss.
    replicas = {tuple(s) for s in samplers}
    per_replica = [result["losses"][[tuple(s) for s in samplers].index(r)] for r in sorted(replicas)]
    global_losses = [sum(step) / len(step) for step in zip(*per_replica)]
    assert global_losses == pytest.approx(single_losses, rel=1e-5, abs=1e-6)
    weights = torch.load(out / f"{name}.pt", weights_only=True)
    assert weights.keys() == single_weights.keys()
    for key, value in single_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    # Every rank holds only its shards of the model (shard groups of 2 in both layouts).
    whole = sum(value.numel() for value in single_weights.values())
    assert all(numel < whole for numel in result["local_numel"])
