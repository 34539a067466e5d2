"""SingleDeviceXLAStrategy on one PJRT CPU device against the same run in plain CPU PyTorch.

One scenario process (the runtime starts once per process) fits, validates, tests, predicts, accumulates and clips,
resumes from a checkpoint and trains in bf16; this process, without torch_xla, checks its numbers and loads its
checkpoint with ``weights_only=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from xla_helpers import run_scenario


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("single_xla")
    result = run_scenario("single", workdir, devices=1)
    result["workdir"] = workdir
    return result


def test_auto_strategy_on_one_device_is_single_xla(single: dict[str, Any]) -> None:
    assert single["strategy"] == "SingleDeviceXLAStrategy" and single["root_device"] == "xla:0"
    assert single["xla_one_device_strategy"] == "XLAStrategy"


def test_device_stats_are_what_the_runtime_reports(single: dict[str, Any]) -> None:
    # The CPU runtime reports no memory figures; a TPU reports bytes_used / bytes_limit / peak_bytes_used.
    assert set(single["device_stats"]) <= {"bytes_used", "bytes_limit", "peak_bytes_used"}


@pytest.mark.parametrize(
    ("key", "tolerance"),
    [
        ("param_diff_32", 1e-6),
        ("validate_diff", 1e-6),
        ("test_diff", 1e-6),
        ("predict_diff", 1e-5),
        ("param_diff_accumulate_clip", 1e-6),
        ("resume_diff", 1e-6),
        ("param_diff_xla_one_device", 1e-6),
        # bfloat16 keeps 8 bits of mantissa: one rounding step of a weight near 1 is 2**-8.
        ("param_diff_bf16-true", 2e-2),
        ("param_diff_bf16-mixed", 1e-2),
    ],
)
def test_matches_cpu_pytorch(single: dict[str, Any], key: str, tolerance: float) -> None:
    assert single[key] <= tolerance, (key, single[key])


def test_accumulation_and_clipping_changed_the_run(single: dict[str, Any]) -> None:
    # Guards the comparison above: the settings really act (the run differs from plain training).
    assert single["accumulate_clip_vs_plain"] > 1e-3


def test_precisions_keep_their_weights_dtype(single: dict[str, Any]) -> None:
    assert single["dtype_bf16-true"] == "torch.bfloat16" and single["dtype_bf16-mixed"] == "torch.float32"
    assert single["predict_shape"] == [64, 1]


def test_checkpoint_loads_without_torch_xla_with_weights_only(single: dict[str, Any]) -> None:
    checkpoint = torch.load(single["checkpoint"], map_location="cpu", weights_only=True)
    final = torch.load(Path(single["workdir"]) / "single_final.pt", weights_only=True)
    assert checkpoint["state_dict"].keys() == final.keys()
    for name, tensor in checkpoint["state_dict"].items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, final[name]), name
    states = checkpoint["optimizer_states"][0]["state"]
    assert all(t.device.type == "cpu" for s in states.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert checkpoint["global_step"] == 16
