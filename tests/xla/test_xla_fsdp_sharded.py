"""xla_fsdp's sharded checkpoints on 2 PJRT CPU devices: each replica writes its own pieces, the same number of
replicas resumes exactly from them, and one device, plain CPU PyTorch and ``phalanx checkpoint consolidate`` read the
directory whole. This process (no torch_xla) checks the files the scenarios wrote."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor
from xla_helpers import run_scenario

from phalanx.cli import main

SCRIPT = Path(__file__).with_name("xla_fsdp_scenarios.py")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("xla_fsdp_sharded")
    result = run_scenario("sharded", workdir, devices=2, script=SCRIPT)
    result["workdir"] = workdir
    alone = tmp_path_factory.mktemp("xla_fsdp_sharded_one")
    # A fresh runtime with one device: xla_fsdp on one of several devices is refused (torch_xla's wrapper fails).
    result.update(run_scenario("sharded_on_one_device", alone, devices=1, script=SCRIPT, SHARDED_SOURCE=str(workdir)))
    return result


def test_each_replica_wrote_its_own_pieces_and_nothing_whole(sharded: dict[str, Any]) -> None:
    directory = Path(sharded["checkpoint"])
    names = sorted(path.name for path in directory.iterdir())
    assert names == [".complete", "phalanx_xla_fsdp.pt", "shards-00000-of-00002.pt", "shards-00001-of-00002.pt"]
    meta = torch.load(directory / "phalanx_xla_fsdp.pt", weights_only=True)
    layout = meta["xla_fsdp_shards"]
    assert layout["world_size"] == 2 and "optimizer_states" not in meta
    assert all(not name.startswith("net.") or "running" in name for name in meta["state_dict"])  # buffers only
    pieces = [torch.load(directory / f"shards-0000{r}-of-00002.pt", weights_only=True) for r in (0, 1)]
    for name, entry in layout["parameters"].items():
        for rank_pieces in pieces:
            assert list(rank_pieces["state_dict"][name].shape) == entry["piece"], name
        assert math.prod(entry["piece"]) * 2 >= math.prod(entry["shape"])
    # The first layer's 256 weights: both replicas hold real values, neither holds them all.
    counts = [int((p["state_dict"]["net.0.weight"] != 0).sum()) for p in pieces]
    assert all(0 < count < 256 for count in counts) and sum(counts) == 256, counts
    assert [len(p["optimizer_states"]) for p in pieces] == [1, 1]


def test_the_same_number_of_replicas_resumes_exactly(sharded: dict[str, Any]) -> None:
    assert sharded["resume_diff"] == 0.0


def test_one_device_and_plain_cpu_resume_from_the_pieces(sharded: dict[str, Any]) -> None:
    assert sharded["one_device_diff"] < 1e-6  # measured: 3e-8 (xla_fsdp, 1 device, the same global batch)
    assert sharded["cpu_diff"] < 1e-6  # measured: 6e-8 (single_device on the CPU, torch only)
    assert sharded["cpu_global_step"] == 8


def test_consolidate_writes_one_file_equal_to_the_weights_at_the_save(
    sharded: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "whole.ckpt"
    assert main(["checkpoint", "consolidate", sharded["checkpoint"], str(output)]) == 0, capsys.readouterr().err
    checkpoint = torch.load(output, weights_only=True)
    model = Regressor(hidden=64)
    model.load_state_dict(checkpoint["state_dict"])  # strict: the module's own names and shapes
    saved = torch.load(Path(sharded["workdir"]) / "after_one_epoch.pt", weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    state = checkpoint["optimizer_states"][0]["state"]
    shapes = [tuple(parameter.shape) for parameter in model.parameters()]
    assert [tuple(state[index]["exp_avg"].shape) for index in range(len(shapes))] == shapes
    assert checkpoint["global_step"] == 4 and "xla_fsdp_shards" not in checkpoint
