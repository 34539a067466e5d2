"""Layouts described by ParallelDims on 4 CPU processes: hybrid sharding on 2 x 2 (the case where neither axis has
size 1), ModelParallel on 2 x 2, and a pipeline of 2 stages composed with data (pp=2 x dp=2) or tensor parallelism
(pp=2 x tp=2) train like one process on the same global batches; one launched job runs every layout."""

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


@pytest.fixture(scope="module")
def one_process_net():
    from pipeline_common import COMPOSED, QUIET, Net, loader

    phalanx.seed_everything(1)
    module = Net()
    phalanx.Trainer(accelerator="cpu", devices=1, **QUIET, **COMPOSED).fit(module, loader(8))
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


@pytest.mark.parametrize(
    ("name", "shape", "samplers"),
    [("pp_dp", [2, 2, 1], [[2, 0], [2, 1], [2, 0], [2, 1]]), ("pp_tp", [2, 1, 2], [[1, 0]] * 4)],
)
def test_a_pipeline_composed_with_data_or_tensor_parallelism_trains_like_one_process(
    job, one_process_net, name, shape, samplers
):
    out, results = job
    single_losses, single_weights = one_process_net
    result = results[name]
    assert result["mesh"] == [["pipeline_parallel", "data_parallel", "tensor_parallel"], shape]
    # Samplers split the data over the data-parallel ranks only: both stages of a replica read the same batches.
    assert [[s["num_replicas"], s["rank"]] for s in result["sampler"]] == samplers
    assert result["stages"] == [[0], [0], [1], [1]]
    # Every rank logs its replica's loss (broadcast from the last stage); the replicas' mean is one process's loss.
    first_of: dict[int, int] = {}  # a replica's (data-parallel rank's) first global rank
    for rank, (_, replica) in enumerate(samplers):
        first_of.setdefault(replica, rank)
    assert all(result["losses"][rank] == result["losses"][first_of[s[1]]] for rank, s in enumerate(samplers))
    replicas = [result["losses"][rank] for rank in first_of.values()]
    assert [sum(step) / len(step) for step in zip(*replicas)] == pytest.approx(single_losses, rel=1e-5, abs=1e-6)
    # The weights after every step were clipped by one norm over all stages and shards: one process's weights.
    weights = torch.load(out / f"{name}.pt", weights_only=True)
    assert weights.keys() == single_weights.keys()
    for key, value in single_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    # Each rank holds its stage's parameters only, and of those its data or tensor shard.
    held = [set(numel) for numel in result["local_numel"]]
    assert held[0] == held[1] and held[2] == held[3] and not held[0] & held[2] and held[0] | held[2] == weights.keys()
    for rank, numel in enumerate(result["local_numel"]):
        for key, count in numel.items():
            whole = single_weights[key]
            if name == "pp_dp":  # every parameter's rows are dealt to the two data-parallel ranks as torch.chunk does
                rows = torch.arange(whole.shape[0]).chunk(2)
                assert count == (len(rows[rank % 2]) if rank % 2 < len(rows) else 0) * whole[0].numel()
            else:  # the blocks' linear layers are split over the tensor axis; the rest is replicated
                assert count == (whole.numel() // 2 if ".linear." in key else whole.numel())
