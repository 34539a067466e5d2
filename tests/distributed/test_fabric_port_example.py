"""examples/fabric_port/gpt_port.py, the Fabric-style GPT loop on phalanx.Cohort, at tiny sizes: the validation loss
falls, and a fresh Cohort resumed from the middle checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from phalanx_distributed import assert_ok, clean_environment, run

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fabric_port" / "gpt_port.py"


@pytest.mark.parametrize(
    ("strategy", "devices", "extra"),
    [
        ("single_device", 1, []),
        ("ddp", 2, []),
        ("fsdp", 2, []),
        ("deepspeed_stage_2", 2, ["--max-norm", "0"]),  # DeepSpeed clips in its engine (its config's threshold)
    ],
)
def test_the_ported_loop_learns_and_resumes_exactly(tmp_path, strategy, devices, extra):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'phalanx[deepspeed]')")
    command = [sys.executable, str(EXAMPLE), "--strategy", strategy, "--devices", str(devices)]
    command += ["--out", str(tmp_path), "--check", *extra]
    assert_ok(run(command, env=clean_environment(DS_ACCELERATOR="cpu"), timeout=600))
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["losses"]) == 12
    assert result["validation"][-1] < result["validation"][0]
    assert result["resume_difference"] == 0.0
