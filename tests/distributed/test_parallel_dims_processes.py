"""Layouts described by ParallelDims on 4 CPU processes: hybrid sharding on 2 x 2 (the case where neither axis has
size 1), ModelParallel on 2 x 2, and a pipeline of 2 stages composed with data (pp=2 x dp=2) or tensor parallelism
(pp=2 x tp=2) train like one process on the same global batches; one launched job runs every layout. The two composed
pipelines' sharded checkpoints move: each resumes under the other composed layout (in the job), and on one process
and through ``phalanx checkpoint consolidate`` (here), ending where one process's unbroken run ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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


def named_optimizer_state(trainer: phalanx.Trainer, module: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    from phalanx.utilities.optimizer_names import state_by_name

    return {name: dict(entries) for name, entries in state_by_name(trainer.optimizers[0], module)["state"].items()}


def fit_one_process(epochs: int, ckpt_path: Path | None = None) -> tuple[list[float], list[Any]]:
    """``AdamNet`` on one process under the composed runs' options for ``epochs`` epochs (from ``ckpt_path`` if
    given): its losses, and its weights and AdamW's state (by parameter name) at the end of each epoch."""
    from pipeline_common import COMPOSED, QUIET, AdamNet, loader

    class Recorded(AdamNet):
        def on_train_epoch_end(self) -> None:
            weights = {key: value.clone() for key, value in self.state_dict().items()}
            state = named_optimizer_state(self.trainer, self)
            ends.append((weights, {n: {k: v.clone() for k, v in e.items()} for n, e in state.items()}))

    ends: list[Any] = []
    phalanx.seed_everything(1)
    module = Recorded()
    options = {**QUIET, **COMPOSED, "max_epochs": epochs}
    phalanx.Trainer(accelerator="cpu", devices=1, **options).fit(module, loader(8), ckpt_path=ckpt_path)
    return module.losses, ends


@pytest.fixture(scope="module")
def one_process_net():
    """Two epochs of four batches, unbroken: the first is what the composed layouts' fits reproduce, the second what
    every run resumed from their checkpoints does."""
    return fit_one_process(epochs=2)


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


def replicas_mean(losses: list[list[float]], samplers: list[list[int]]) -> list[float]:
    """The loss at each step over the data-parallel replicas, checking that the ranks of a replica agree."""
    first_of: dict[int, int] = {}  # a replica's (data-parallel rank's) first global rank
    for rank, (_, replica) in enumerate(samplers):
        first_of.setdefault(replica, rank)
    assert all(losses[rank] == losses[first_of[s[1]]] for rank, s in enumerate(samplers))
    replicas = [losses[rank] for rank in first_of.values()]
    return [sum(step) / len(step) for step in zip(*replicas)]


def assert_close_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == reference.keys(), what
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=f"{what} {key}")


def assert_close_optimizer(ours: dict[str, dict[str, torch.Tensor]], reference: dict[str, dict[str, Any]]) -> None:
    """AdamW's step and moments of every parameter, by name; exp_avg_sq (~1e-5 here) with a finer atol."""
    assert ours.keys() == reference.keys()
    for name, entries in reference.items():
        assert ours[name].keys() == entries.keys(), name
        for key, value in entries.items():
            atol = 1e-9 if key == "exp_avg_sq" else 1e-6
            torch.testing.assert_close(ours[name][key], value, rtol=1e-5, atol=atol, msg=f"{name} {key}")


@pytest.mark.parametrize(
    ("name", "shape", "samplers"),
    [("pp_dp", [2, 2, 1], [[2, 0], [2, 1], [2, 0], [2, 1]]), ("pp_tp", [2, 1, 2], [[1, 0]] * 4)],
)
def test_a_pipeline_composed_with_data_or_tensor_parallelism_trains_like_one_process(
    job, one_process_net, name, shape, samplers
):
    out, results = job
    losses, ((single_weights, single_optimizer), _) = one_process_net
    single_losses = losses[:4]  # the first epoch
    result = results[name]
    assert result["mesh"] == [["pipeline_parallel", "data_parallel", "tensor_parallel"], shape]
    # Samplers split the data over the data-parallel ranks only: both stages of a replica read the same batches.
    assert [[s["num_replicas"], s["rank"]] for s in result["sampler"]] == samplers
    assert result["stages"] == [[0], [0], [1], [1]]
    # Every rank logs its replica's loss (broadcast from the last stage); the replicas' mean is one process's loss.
    assert replicas_mean(result["losses"], samplers) == pytest.approx(single_losses, rel=1e-5, abs=1e-6)
    # The weights after every step were clipped by one norm over all stages and shards: one process's weights, and
    # AdamW's state (what a checkpoint written now holds).
    weights = torch.load(out / f"{name}.pt", weights_only=True)
    assert_close_tensors(weights, single_weights, "weight")
    assert_close_optimizer(torch.load(out / f"{name}.optimizer.pt", weights_only=True), single_optimizer)
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


#: Each composed layout's sampler (num_replicas, rank) per global rank, as asserted above.
SAMPLERS = {"pp_dp": [[2, 0], [2, 1], [2, 0], [2, 1]], "pp_tp": [[1, 0]] * 4}
#: The parameters of each stage (ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1).
STAGE_OF = {"embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1}


def stage_of(key: str) -> int:
    """The stage of a checkpoint entry (``model/<parameter>`` or ``optimizer/0/<parameter>/<entry>``)."""
    parameter = key.removeprefix("model/").removeprefix("optimizer/0/")
    return next(stage for prefix, stage in STAGE_OF.items() if parameter.startswith(prefix + "."))


@pytest.mark.parametrize("name", ["pp_dp", "pp_tp"])
def test_a_composed_pipeline_checkpoint_is_complete_and_each_rank_wrote_only_its_shard(job, name):
    import torch.distributed.checkpoint as dcp

    from phalanx.trainer.checkpoint import COMPLETE_MARKER

    out, _ = job
    directory, gathered = out / f"{name}.ckpt", torch.load(out / f"{name}.pt", weights_only=True)
    assert (directory / COMPLETE_MARKER).is_file()
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    tensors = {key: entry for key, entry in metadata.state_dict_metadata.items() if hasattr(entry, "chunks")}
    # The data bytes of each rank's file (__<rank>_0.distcp), from the chunks of the tensors it holds.
    written: dict[int, dict[str, int]] = {rank: {} for rank in range(4)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in tensors:  # plain values (param_groups' entries) written as bytes
            continue
        rank = int(info.relative_path.split("_")[2])
        chunk = next(c for c in tensors[index.fqn].chunks if list(c.offsets) == list(index.offset or []))
        size = tensors[index.fqn].properties.dtype.itemsize * torch.Size(chunk.sizes).numel()
        written[rank][index.fqn] = written[rank].get(index.fqn, 0) + size
    whole = {key: entry.properties.dtype.itemsize * entry.size.numel() for key, entry in tensors.items()}
    # Every tensor of both stages (weights, AdamW's moments and steps) was written once: the files hold its bytes.
    assert {key for key in whole if key.startswith("model/")} == {f"model/{key}" for key in gathered}
    assert all(sum(part.get(key, 0) for part in written.values()) == size for key, size in whole.items())
    for rank, part in written.items():
        stage = rank // 2
        # A rank wrote only tensors of its own stage, and of those only its shard: less than the stage's bytes.
        assert part and all(stage_of(key) == stage for key in part), rank
        stage_bytes = sum(size for key, size in whole.items() if stage_of(key) == stage)
        assert 0 < sum(part.values()) < stage_bytes, rank
        if name == "pp_dp":  # each data-parallel shard of a weight holds half its rows (the head's one row: all)
            weights = [key for key in part if key.startswith("model/") and tensors[key].size[0] > 1]
            assert weights and all(part[key] == whole[key] // 2 for key in weights), rank


@pytest.mark.parametrize(("source", "target"), [("pp_dp", "pp_tp"), ("pp_tp", "pp_dp")])
def test_a_composed_pipeline_checkpoint_resumes_under_the_other_layout_like_the_unbroken_run(
    job, one_process_net, source, target
):
    out, results = job
    losses, (_, (weights, optimizer)) = one_process_net
    resumed = results[f"{source}__{target}"]
    assert resumed["global_step"] == 8 and resumed["mesh"][1] == {"pp_dp": [2, 2, 1], "pp_tp": [2, 1, 2]}[target]
    # The second epoch, on shards split the other way: the loss at each step, the weights and AdamW's state.
    assert replicas_mean(resumed["losses"], SAMPLERS[target]) == pytest.approx(losses[4:], rel=1e-5, abs=1e-6)
    assert_close_tensors(torch.load(out / f"{source}__{target}.pt", weights_only=True), weights, "weight")
    assert_close_optimizer(torch.load(out / f"{source}__{target}.optimizer.pt", weights_only=True), optimizer)


@pytest.mark.parametrize("name", ["pp_dp", "pp_tp"])
def test_a_composed_pipeline_checkpoint_consolidates_and_resumes_on_one_process(job, one_process_net, name, tmp_path):
    from phalanx.cli import main as cli

    out, _ = job
    directory = out / f"{name}.ckpt"
    assert cli(["checkpoint", "consolidate", str(directory), str(tmp_path / "whole.ckpt")]) == 0
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=True)
    assert whole["global_step"] == 4
    # The consolidated weights and AdamW's state (keyed by name) are what the job gathered from its ranks after the fit
    # that wrote the directory.
    assert_close_tensors(whole["state_dict"], torch.load(out / f"{name}.pt", weights_only=True), "consolidated")
    (state,) = [optimizer["state"] for optimizer in whole["optimizer_states"]]
    assert_close_optimizer(state, torch.load(out / f"{name}.optimizer.pt", weights_only=True))
    # Resumed on one process, the second epoch is the unbroken run's: losses, weights and AdamW's state.
    losses, (_, (weights, optimizer)) = one_process_net
    resumed_losses, ends = fit_one_process(epochs=2, ckpt_path=directory)
    assert resumed_losses == pytest.approx(losses[4:], rel=1e-5, abs=1e-6)
    ((resumed_weights, resumed_optimizer),) = ends
    assert_close_tensors(resumed_weights, weights, "weight")
    assert_close_optimizer(resumed_optimizer, optimizer)
