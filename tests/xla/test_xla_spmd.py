"""XLASPMDStrategy: one process drives two PJRT CPU devices with sharding annotations, against one CPU process.

'xla_spmd' splits the batch and each parameter over the devices; 'xla_spmd_dp' splits only the batch. Both must end
where plain CPU PyTorch ends on the same global batch, and the sharded parameters must really be split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from xla_helpers import run_scenario


@pytest.fixture(scope="module")
def spmd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("spmd", tmp_path_factory.mktemp("xla_spmd"), devices=2)


@pytest.mark.parametrize("name", ["xla_spmd", "xla_spmd_dp"])
def test_matches_one_cpu_process(spmd: dict[str, Any], name: str) -> None:
    assert spmd[f"{name}_strategy"] == "XLASPMDStrategy" and spmd[f"{name}_world_size"] == 1
    assert spmd[f"{name}_param_diff"] <= 1e-6
    assert abs(spmd[f"{name}_validate"] - spmd[f"{name}_cpu_validate"]) <= 1e-6


@pytest.mark.parametrize(
    ("name", "sharding", "shard_shapes"),
    [
        ("xla_spmd", "{devices=[2,1]0,1}", [[8, 4], [8, 4]]),  # Linear(4, 16).weight: 16 rows, 8 on each device
        ("xla_spmd_dp", "{replicated}", [[16, 4], [16, 4]]),
    ],
)
def test_parameter_shards_are_split_across_devices(
    spmd: dict[str, Any], name: str, sharding: str, shard_shapes: list[list[int]]
) -> None:
    assert spmd[f"{name}_weight_sharding"] == sharding
    assert spmd[f"{name}_shard_shapes"] == shard_shapes


def test_checkpoint_is_whole_loads_with_weights_only_and_resumes_exactly(spmd: dict[str, Any]) -> None:
    checkpoint = torch.load(spmd["xla_spmd_checkpoint"], map_location="cpu", weights_only=True)
    assert list(checkpoint["state_dict"]["net.0.weight"].shape) == [16, 4]  # gathered from both devices
    assert spmd["resume_diff"] <= 1e-6
    assert spmd["resumed_weight_sharding"] == "{devices=[2,1]0,1}"  # loading kept the parameter split
