"""FSDP on 2 CPU processes, both state_dict_types: one dump and one gather per save point with save_top_k=1 and
save_last=True; last.ckpt is a copy made through the strategy's CheckpointIO and loads equal to the top-k file.
One launch (scripts/save_once_job.py) runs both."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

SAVE_POINTS = [2, 4, 6]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("save_once")
    assert_ok(run_script("save_once_job.py", str(out), timeout=300))
    return {
        (kind, rank): json.loads((out / f"{kind}-rank{rank}.json").read_text())
        for kind in ("full", "sharded")
        for rank in (0, 1)
    }


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_one_dump_and_one_gather_per_save_point(results, kind, rank):
    result = results[(kind, rank)]
    assert result["global_step"] == 6
    assert result["dumps"] == SAVE_POINTS
    assert result["gathers"] == SAVE_POINTS


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_last_is_a_copy_through_the_checkpoint_io_and_equals_the_top_k_file(results, kind):
    names = [f"epoch=0-step={step}.ckpt" for step in SAVE_POINTS]
    copies = [["copy", name, "last.ckpt"] for name in names]
    rank0 = results[(kind, 0)]
    # 'full' writes through the IO on rank 0; 'sharded' writes its directory itself (every rank; issue 14 item 1).
    saves = [["save", name] for name in names] if kind == "full" else []
    assert [call for call in rank0["io"] if call[0] == "save"] == saves
    assert [call for call in rank0["io"] if call[0] == "copy"] == copies
    assert results[(kind, 1)]["io"] == []  # rank 1 neither saves nor copies through the IO
    assert rank0["files"] == [names[-1], "last.ckpt"]
    assert rank0["last_equals_top_k"]
