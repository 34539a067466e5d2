"""xla_fsdp (torch_xla's fully sharded data parallel) on 2 PJRT CPU devices against the same run in plain CPU PyTorch.

One scenario process trains (Adam, validation, a checkpoint), accumulates and clips, and resumes; this process,
without torch_xla, checks the numbers and loads the checkpoint with ``weights_only=True`` into a single-device model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor
from xla_helpers import run_scenario


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("xla_fsdp")
    result = run_scenario("fully_sharded", workdir, devices=2)
    result["workdir"] = workdir
    return result


def test_trains_like_one_cpu_process_on_the_global_batch(sharded: dict[str, Any]) -> None:
    assert sharded["strategy"] == "XLAFSDPStrategy"
    assert sharded["param_diff"] < 1e-6  # measured: 6e-8 (Adam, 2 epochs, validation each epoch)
    assert sharded["param_diff_auto_wrap"] < 1e-6  # auto_wrap_policy={nn.Linear}: nested shard units


def test_accumulation_and_clipping_match_and_change_the_run(sharded: dict[str, Any]) -> None:
    assert sharded["param_diff_accumulate_clip"] < 1e-6  # the norm over the shards is the whole model's norm
    assert sharded["accumulate_clip_vs_plain"] > 1e-3


def test_each_replica_holds_its_own_piece_of_every_parameter(sharded: dict[str, Any]) -> None:
    ranks = sharded["shards"]
    for rank in ranks:
        assert rank["registered"] == 0  # the module's own parameters were replaced by the wrapper's shards
        for name, (shard, whole) in rank["shards"].items():
            assert len(shard) == 1 and shard[0] * 2 >= torch.Size(whole).numel(), name  # flat: half or more
    # The first layer's 256 weights are split 128 + 128: both replicas hold real values, none holds them all.
    assert [rank["nonzero"]["net.0.weight"] for rank in ranks] == [128, 128]


def test_the_checkpoint_is_whole_and_loads_into_a_plain_cpu_model(sharded: dict[str, Any]) -> None:
    checkpoint = torch.load(sharded["checkpoint"], weights_only=True)
    model = Regressor(hidden=64)
    model.load_state_dict(checkpoint["state_dict"])  # strict: the module's own names and shapes
    final = torch.load(Path(sharded["workdir"]) / "fsdp_final.pt", weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0)
    state = checkpoint["optimizer_states"][0]["state"]
    shapes = [tuple(parameter.shape) for parameter in model.parameters()]
    assert [tuple(state[index]["exp_avg"].shape) for index in range(len(shapes))] == shapes  # Adam's, whole


def test_resuming_from_the_checkpoint_ends_where_the_uninterrupted_run_ends(sharded: dict[str, Any]) -> None:
    assert sharded["resume_diff"] == 0.0
