"""phalanx.Cohort on 2 CPU processes beyond test_cohort_processes.py: accumulation (DDP, DeepSpeed stages 1-3),
generator states on resume, logging, model_parallel and DeepSpeed stages 1 and 3, each against Trainer.fit on the same
strategy; a pipeline of two stages through cohort.forward_backward against one process. Two jobs
(scripts/cohort_strategies_job.py): 'ddp' and 'deepspeed'."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

# What tests/distributed/test_sharded.py allows tensor parallelism against one process, and test_deepspeed.py allows
# DeepSpeed's accumulation against DDP's.
TENSOR_PARALLEL_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
DEEPSPEED_ACCUMULATION_ATOL = 1e-5


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort_strategies_ddp")
    assert_ok(run_script("cohort_strategies_job.py", str(out), "ddp", timeout=400))
    return out, json.loads((out / "ddp.json").read_text())


@pytest.fixture(scope="module")
def deepspeed_job(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    out = tmp_path_factory.mktemp("cohort_strategies_deepspeed")
    # The first DeepSpeed start on a machine compiles a small communication op (minutes on 2 cores).
    job = run_script(
        "cohort_strategies_job.py", str(out), "deepspeed", env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600
    )
    assert_ok(job)
    return out, json.loads((out / "deepspeed.json").read_text())


def test_accumulation_through_no_backward_sync_on_ddp_equals_the_trainer_bitwise(ddp_job):
    _, result = ddp_job
    assert result["world_size"] == 2
    assert result["accumulation_bitwise"] is True


def test_a_dropout_loop_resumed_from_a_cohort_checkpoint_on_ddp_goes_on_bitwise(ddp_job):
    _, result = ddp_job
    assert result["rng_resumed_bitwise"] is True
    assert result["rng_not_restored_differs"] is True  # restore_rng=False: the dropout masks change, so would the test


def test_self_log_and_cohort_log_land_in_the_csv_once_written_by_rank_zero(ddp_job):
    _, result = ddp_job
    with open(result["logging"]["csv"], newline="") as file:
        rows = [{key: value for key, value in row.items() if value} for row in csv.DictReader(file)]
    per_step = [{"loss"}, {"rank_sum"}, {"own_rank"}, {"a", "b"}]  # 'not_written' was logged with logger=False
    assert [set(row) - {"step"} for row in rows] == per_step * 3 + [{"lr"}, {"epoch_metric", "count"}]
    assert [int(row["step"]) for row in rows] == [0] * 4 + [1] * 4 + [2] * 4 + [100, 3]
    assert {row["rank_sum"] for row in rows if "rank_sum" in row} == {"1.0"}  # sync_dist, reduce_fx='sum': 0 + 1
    assert {row["own_rank"] for row in rows if "own_rank" in row} == {"0.0"}  # rank zero's own value only
    assert (rows[-1]["epoch_metric"], rows[-1]["count"]) == ("7.0", "3")


@pytest.fixture(scope="module")
def single_process_run():
    """The Cohort loop of the job's model_parallel run, on one process: 16 steps of the TransformerBlock."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from sharded_common import TransformerBlock, sequences
    finally:
        sys.path.remove(str(SCRIPTS))
    from torch.utils.data import DataLoader

    import phalanx

    torch.manual_seed(13)  # what the job's seed_everything(13) does to torch's generator
    block = TransformerBlock()
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)
    model, optimizer = cohort.setup(block, torch.optim.SGD(block.parameters(), lr=0.02, momentum=0.9))
    loader = cohort.setup_dataloaders(DataLoader(sequences(), batch_size=8))
    for _ in range(2):
        for index, batch in enumerate(loader):
            optimizer.zero_grad()
            cohort.backward(model.training_step(batch, index))
            optimizer.step()
    return block


def test_model_parallel_through_the_cohort_equals_the_trainer_and_one_process(ddp_job, single_process_run):
    out, result = ddp_job
    parallel = result["model_parallel"]
    assert {"q.weight", "k.weight", "v.weight", "o.weight", "up.weight", "down.weight"} <= set(parallel["sharded"])
    assert parallel["trainer_difference"] == 0.0  # Trainer.fit on model_parallel runs the very same computation
    single = single_process_run
    assert parallel["losses"] == pytest.approx(single.losses, rel=1e-4, abs=1e-5)
    ours = torch.load(out / "model_parallel.pt", weights_only=True)
    reference = {name: value.detach() for name, value in single.state_dict().items()}
    assert ours.keys() == reference.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], **TENSOR_PARALLEL_TOLERANCE)


def test_model_parallel_checkpoint_loads_back_exactly_and_the_trainer_resumes_it(ddp_job):
    _, result = ddp_job
    parallel = result["model_parallel"]
    assert parallel["loaded_difference_to_saved"] == 0.0  # the sharded directory read back into a fresh Cohort
    assert parallel["loaded_then_trained_difference"] == 0.0  # the momentum came back too
    assert parallel["trainer_resumed"] == [8, 16]  # the Trainer ran the 8 steps after the Cohort's 8
    assert parallel["trainer_resumed_difference"] == 0.0


def test_fsdp_cpu_offload_matches_the_trainer_and_its_checkpoint_loads_in_both(ddp_job):
    result = ddp_job[1]["fsdp_cpu_offload"]
    assert result["max_difference_to_trainer"] == 0.0
    assert result["trainer_resumed_global_step"] == 12
    assert result["loaded"] == [0.0, 10]


@pytest.fixture(scope="module")
def one_process_pipeline():
    """The job's pipeline loop on one process, in plain PyTorch: the whole model, the loss of the whole batch."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from pipeline_common import AdamNet, loader
    finally:
        sys.path.remove(str(SCRIPTS))
    import phalanx

    phalanx.seed_everything(1)
    module = AdamNet()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses, batches = [], list(loader(8))
    for batch in batches:
        loss = module.pipeline_loss(module(batch[0]), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        predictions = module(batches[0][0])
    return losses, module.state_dict(), predictions


def test_a_cohort_loop_over_two_pipeline_stages_trains_like_one_process(ddp_job, one_process_pipeline):
    out, result = ddp_job
    pipeline, tensors = result["pipeline"], torch.load(out / "pipeline.pt", weights_only=True)
    losses, weights, predictions = one_process_pipeline
    for rank_losses in pipeline["losses"]:  # the batch's loss reaches every rank of the pipeline
        assert rank_losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert pipeline["steps"] == len(losses)
    assert tensors["weights"].keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(
            tensors["weights"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    torch.testing.assert_close(tensors["predictions"], predictions, rtol=1e-5, atol=1e-6)
    # Each rank holds (and optimizes) only its stage: the optimizer made over the whole model was cut down by setup.
    whole = sum(value.numel() for value in weights.values())
    assert sum(pipeline["held"]) == whole and all(0 < held < whole for held in pipeline["held"])
    # The schedule runs every backward: cohort.backward is refused, naming what to call instead.
    assert "cohort.forward_backward(batch, batch_idx)" in pipeline["refusal"]


def test_a_cohort_checkpoint_of_pipeline_stages_goes_on_as_the_unbroken_run(ddp_job):
    out, result = ddp_job
    pipeline, tensors = result["pipeline"], torch.load(out / "pipeline.pt", weights_only=True)
    save_at = len(pipeline["losses"][0]) - len(pipeline["resumed"][0])
    for rank_resumed, rank_losses in zip(pipeline["resumed"], pipeline["losses"]):
        assert rank_resumed == pytest.approx(rank_losses[save_at:], rel=1e-6, abs=1e-7)
    for name, value in tensors["weights"].items():
        torch.testing.assert_close(
            tensors["resumed"][name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The example of docs/pipeline.md ran in the same processes (its asserts too): three epochs of four batches.
    example = pipeline["docs_example"]
    assert len(example) == 12 and example[-1] < example[0]


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2_offload", "deepspeed_stage_3_offload"])
def test_zero_offload_with_deepspeed_cpu_adam_matches_the_trainer(deepspeed_job, strategy):
    # DeepSpeedCPUAdam made on the plain module before setup, as in a plain torch loop
    assert deepspeed_job[1][f"{strategy}_difference"] == 0.0


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_3"])
def test_deepspeed_stage_matches_the_trainer_and_the_trainer_resumes_the_cohort_checkpoint(deepspeed_job, strategy):
    _, result = deepspeed_job
    assert result[strategy]["max_difference_to_trainer"] == 0.0
    assert result[strategy]["trainer_resumed_global_step"] == 12  # resumed at the Cohort's step 10, then 2 more
    assert result[strategy]["loaded"] == [0.0, 10]  # a fresh Cohort reads it back: weights and global_step


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_accumulation_on_deepspeed_equals_the_trainer_and_ddp(ddp_job, deepspeed_job, strategy):
    out, result = deepspeed_job
    ddp_out, _ = ddp_job
    # The same loop as on DDP: non-final micro-batches inside no_backward_sync, optimizer.step() once per window.
    assert result[f"{strategy}_accumulation_difference"] == 0.0  # Trainer.fit(accumulate_grad_batches=2)
    ours = torch.load(out / f"{strategy}_accumulation.pt", weights_only=True)
    reference = torch.load(ddp_out / "ddp_accumulation.pt", weights_only=True)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.allclose(ours[name], reference[name], rtol=0, atol=DEEPSPEED_ACCUMULATION_ATOL), name
