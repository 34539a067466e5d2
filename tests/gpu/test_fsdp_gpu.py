"""FSDP on CUDA with NCCL: run on a machine with GPUs (skipped elsewhere)."""

from __future__ import annotations

import json

import pytest
import torch
from phalanx_distributed import assert_ok, run_script

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs a CUDA device with bfloat16"
)


def test_fsdp_bf16_and_cpu_offload_on_gpus(tmp_path):
    out = tmp_path / "fsdp_gpu.json"
    assert_ok(run_script("fsdp_gpu.py", str(out), timeout=600))
    results = json.loads(out.read_text())
    for name in ("bf16", "offload"):
        assert results[name]["last"] < results[name]["first"]
    assert results["bf16"]["param_device"] == "cuda"
    assert results["offload"]["param_device"] == "cpu"  # sharded parameters live in host memory
