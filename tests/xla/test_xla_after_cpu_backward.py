"""A single_xla fit after the process's autograd engine started on another device (PyTorch sizes its per-device queues
at the first backward pass; one that ran before torch_xla was imported left none for XLA and tripped an internal
assert). Each case is a fresh process; the other order (XLA first) is the control."""

from __future__ import annotations

from pathlib import Path

import pytest
from xla_helpers import run_scenario

SCRIPT = Path(__file__).with_name("xla_backward_scenarios.py")


@pytest.mark.parametrize(
    ("before", "in_thread"),
    [
        ("nothing", False),  # the engine starts with XLA's queues: nothing changes
        ("plain_cpu_backward", True),  # a user's own backward pass before importing torch_xla
        ("phalanx_cpu_fit", True),  # a phalanx fit on the CPU first
    ],
)
def test_single_xla_fit_works_whatever_ran_backward_before(tmp_path: Path, before: str, in_thread: bool) -> None:
    result = run_scenario(before, tmp_path, devices=1, timeout=300, script=SCRIPT)
    for kind in ("automatic", "manual"):
        assert result[f"{kind}_steps"] == 8
        assert result[f"{kind}_diff"] <= 1e-6, (kind, result)
        # Backward passes run in the training thread only where the engine lacks XLA queues; the setting is given back.
        assert result[f"{kind}_multithreaded"] == [not in_thread], (kind, result)
    assert result["multithreaded_after"] is True
