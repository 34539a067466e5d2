"""Every strategy on CUDA with NCCL: world size 1 on any GPU, world size 2 where two GPUs are visible.

Each case fits a small MLP for 15 steps in a fresh process (``scripts/gpu_fit.py``), so a process group or a DeepSpeed
engine never outlives its test. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCRIPT = Path(__file__).parent / "scripts" / "gpu_fit.py"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
STRATEGIES = [
    "single_device",
    "ddp",
    "ddp_spawn",
    "fsdp",
    "model_parallel",
    pytest.param("deepspeed_stage_2", marks=needs_deepspeed),
    pytest.param("deepspeed_stage_3", marks=needs_deepspeed),
]


def fit(tmp_path: Path, strategy: str, devices: int, precision: str) -> dict:
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), str(out), strategy, str(devices)]
    assert_ok(run([*command, precision], env=clean_environment(), timeout=300))
    return json.loads(out.read_text())


def check(result: dict, strategy: str, world_size: int) -> None:
    assert result["steps"] == 15 and result["last"] < result["first"], result
    assert result["param_device"] == "cuda", result
    if strategy != "single_device":
        assert (result["backend"], result["world_size"]) == ("nccl", world_size), result


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_at_world_size_1_on_nccl(tmp_path, strategy):
    check(fit(tmp_path, strategy, 1, "32-true"), strategy, 1)


@needs_two_gpus
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "single_device"])
def test_every_strategy_trains_on_two_gpus(tmp_path, strategy):
    check(fit(tmp_path, strategy, 2, "32-true"), strategy, 2)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_precision_trains_with_the_data_parallel_strategies(tmp_path, strategy, precision):
    if "bf16" in precision and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    check(fit(tmp_path, strategy, 1, precision), strategy, 1)
