"""A recording CheckpointIO sees every save, load and removal of every strategy: single_device in this process,
ddp, fsdp (full, sharded, sharded at a file:// URL), model_parallel and deepspeed 1/2/3 on 2 CPU processes (one
launch: scripts/checkpoint_io_job.py), also DeepSpeed ZeRO-2 checkpoints converted on resume (to ZeRO-3, to ddp);
an asynchronous FSDP sharded save returns while its write is pending."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script
from strategy_cases import names

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint_io")
    assert_ok(run_script("checkpoint_io_job.py", str(out), timeout=400))
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def _deepspeed_files(stage: int, rank: int) -> list[str]:
    weights = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] if stage == 3 else []
    weights += ["mp_rank_00_model_states.pt"] if stage < 3 and rank == 0 else []
    return [*weights, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


def expected(kind: str, rank: int) -> tuple[str, list[list[str]]]:
    """(layout, IO calls of ``rank``) for: fit, save NAME, resume from NAME, remove NAME."""
    names = {"fsdp_sharded_url": "url", "deepspeed_2_url": "ds_url", "deepspeed_2_as_3": "ds2_as_3"}
    name = {**names, "deepspeed_2_as_ddp": "ds2_as_ddp"}.get(kind, kind) + ".ckpt"
    removal = [["remove", name]] if rank == 0 else []
    if kind == "fsdp_sharded_async":  # DCP's async_save writes the shards into the IO's staging directory
        return "sharded", [["start", name], ["finish", name], ["load_sharded", name], *removal]
    if kind in ("ddp", "fsdp_full"):  # one file: rank 0 writes it, every rank reads it
        return "file", ([["save", name]] if rank == 0 else []) + [["load", name]] + removal
    if kind in ("fsdp_sharded", "fsdp_sharded_url", "model_parallel"):  # every rank writes and reads its shards
        return "sharded", [["save_sharded", name], ["load_sharded", name], *removal]
    stage = int(kind.split("_")[1])
    saves = [["save", file] for file in _deepspeed_files(stage, rank)]
    saves += [["save", "phalanx_deepspeed_state.pt"]] if rank == 0 else []
    # Resuming, DeepSpeed's engine reads its files through the IO too (the module's file twice: weights, then its
    # client state), each rank the model file it needs and its own optimizer partition.
    model_file = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    reads = [["load", model_file], ["load", model_file], ["load", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]]
    if kind == "deepspeed_2_as_ddp":  # ddp reads the directory whole, as one checkpoint
        reads = [["load", name]]
    elif kind == "deepspeed_2_as_3":  # converted: every rank reads the state, the weights and every partition
        optimizer_files = [f"zero_pp_rank_{other}_mp_rank_00_optim_states.pt" for other in (0, 1)]
        reads = [["load", file] for file in ("phalanx_deepspeed_state.pt", model_file, *optimizer_files)]
    state_read = [] if kind == "deepspeed_2_as_ddp" else [["load", "phalanx_deepspeed_state.pt"]]
    return "deepspeed", [
        ["start", name],
        *saves,
        ["finish", name],
        *state_read,
        *reads,
        *removal,
    ]


#: The job's kinds for each strategy that promises to save, load and remove through the CheckpointIO
#: (tests/strategy_cases.py); a strategy that promises it without kinds here fails at collection.
KINDS_OF = {
    "ddp": ["ddp"],
    "fsdp": ["fsdp_full", "fsdp_sharded", "fsdp_sharded_url"],
    "model_parallel": ["model_parallel"],
    **{f"deepspeed_stage_{stage}": [f"deepspeed_{stage}"] for stage in (1, 2, 3)},
}
KINDS = [kind for name in names("checkpoint_io") for kind in KINDS_OF[name]]
ASYNC_KINDS = ["fsdp_sharded_async", "deepspeed_2_async", "deepspeed_2_url", "deepspeed_2_as_3", "deepspeed_2_as_ddp"]


def test_every_strategy_that_promises_it_has_its_kinds_and_nothing_else():
    assert sorted(KINDS_OF) == sorted(names("checkpoint_io"))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", KINDS + ASYNC_KINDS)
def test_every_save_load_and_removal_of_every_strategy_reaches_the_checkpoint_io(results, kind, rank):
    result = results[rank][kind]
    layout, calls = expected(kind, rank)
    assert result["layout"] == layout
    assert result["io"] == calls
    assert result["resumed_step"] == 3  # resumed at step 2 from the checkpoint, then one more step
    assert result["removed"]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_async_fsdp_sharded_save_returns_before_its_write_and_then_loads(results, rank):
    result = results[rank]["async"]
    assert result["pending_at_return"]  # returned while the write waited; nothing published yet
    assert result["loads_equal"]  # after the write: the checkpoint holds the weights at the save
    # Staged and published through the wrapped IO (the tensors go through DCP's async_save).
    assert result["inner_io"] == [["start", "async.ckpt"], ["finish", "async.ckpt"]]


def test_single_device_saves_loads_and_removes_through_the_checkpoint_io(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    try:
        from checkpoint_io_job import RecordingIO
        from sharded_common import MLP, loader, quiet
    finally:
        sys.path.pop(0)
    io, path = RecordingIO(), str(tmp_path / "single.ckpt")
    trainer = quiet(strategy="single_device", devices=1, max_steps=2, plugins=[io])
    trainer.fit(MLP(), loader(1))
    trainer.save_checkpoint(path)
    resumed = quiet(strategy="single_device", devices=1, max_steps=3, plugins=[io])
    resumed.fit(MLP(), loader(1), ckpt_path=path)
    resumed.strategy.remove_checkpoint(path)
    assert io.calls == [["save", "single.ckpt"], ["load", "single.ckpt"], ["remove", "single.ckpt"]]
    assert resumed.global_step == 3
    assert not (tmp_path / "single.ckpt").exists()
