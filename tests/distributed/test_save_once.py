"""2 CPU processes, FSDP (both state_dict_types) and DeepSpeed ZeRO-2/3 (directory layouts): one dump and one gather
per save point with save_top_k=1 and save_last=True; last.ckpt is a copy made through the strategy's CheckpointIO
and loads equal to the top-k file. One launch (scripts/save_once_job.py) runs them all."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

SAVE_POINTS = [2, 4, 6]
KINDS = ["full", "sharded", "deepspeed_2", "deepspeed_3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("save_once")
    assert_ok(run_script("save_once_job.py", str(out), timeout=300))
    return {
        (kind, rank): json.loads((out / f"{kind}-rank{rank}.json").read_text()) for kind in KINDS for rank in (0, 1)
    }


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_one_dump_and_one_gather_per_save_point(results, kind, rank):
    result = results[(kind, rank)]
    assert result["global_step"] == 6
    assert result["dumps"] == SAVE_POINTS
    assert result["gathers"] == SAVE_POINTS


def expected_calls(kind: str, rank: int) -> list[list[str]]:
    """The CheckpointIO calls of one rank: every layout's saves, copies and removals reach the IO."""
    names = [f"epoch=0-step={step}.ckpt" for step in SAVE_POINTS]
    calls: list[list[str]] = []
    for index, name in enumerate(names):
        if kind == "full":
            calls += [["save", name]] if rank == 0 else []
        elif kind == "sharded":
            calls += [["save_sharded", name]]
        else:  # DeepSpeed: every rank writes its files through the IO; rank 0 adds phalanx's state file
            if kind == "deepspeed_3":  # ZeRO-3: every rank writes its partition of the weights
                files = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"]
            else:  # ZeRO-2: the weights once, from rank 0
                files = ["mp_rank_00_model_states.pt"] if rank == 0 else []
            files += [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
            calls += [["start", name], *[["save", file] for file in files]]
            calls += [["save", "phalanx_deepspeed_state.pt"]] if rank == 0 else []
            calls += [["finish", name]]
        if rank == 0:
            calls += [["remove", names[index - 1]]] if index else []
            calls += [["copy", name, "last.ckpt"]]
    return calls


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_every_save_copy_and_removal_goes_through_the_checkpoint_io(results, kind, rank):
    assert results[(kind, rank)]["io"] == expected_calls(kind, rank)


@pytest.mark.parametrize("kind", KINDS)
def test_last_is_a_copy_through_the_checkpoint_io_and_equals_the_top_k_file(results, kind):
    names = [f"epoch=0-step={step}.ckpt" for step in SAVE_POINTS]
    rank0 = results[(kind, 0)]
    assert [call for call in rank0["io"] if call[0] == "copy"] == [["copy", name, "last.ckpt"] for name in names]
    assert [call for call in results[(kind, 1)]["io"] if call[0] == "copy"] == []  # rank 1 never copies
    assert rank0["files"] == [names[-1], "last.ckpt"]  # older top-k checkpoints removed, nothing left over
    assert rank0["last_equals_top_k"]
    # The same strategy resumed from the copy (step 6) and ran the 2 steps left to max_steps=8.
    assert rank0["resumed"] == [8, 2]
