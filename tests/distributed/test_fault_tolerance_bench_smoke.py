"""bench/bench_fault_tolerance.py at its smallest size: the ``ddp`` baseline (torchrun restarting the whole job after a
kill, resuming with ckpt_path="auto") finishes and is reported. Its ``ddp_ft`` figures are computed from the chaos
tier's run in test_fault_tolerant_chaos.py (one launch for both); the numbers themselves are the bench's to measure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_bench_runs_the_ddp_baseline_under_kills_and_reports_it(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_fault_tolerance
    finally:
        sys.path.remove(str(BENCH))
    arguments = ["--steps", "40", "--hidden", "8", "--batch", "2", "--fail-every", "0.5", "--save-every", "5"]
    arguments += ["--max-kills", "1"]
    results = bench_fault_tolerance.main([*arguments, "--deadline", "240", "--modes", "ddp"])
    assert list(results) == ["ddp restarted whole, failures"]
    result = results["ddp restarted whole, failures"]
    assert result["samples_per_s"] > 0 and result["steps"] == 40
    # Each kill makes torchrun restart the whole job (a new rank 0), which resumes from its last save; a kill that
    # lands on a process torchrun is already stopping makes no new life.
    assert 1 + (result["kills"] > 0) <= result["lives"] <= 1 + result["kills"]
    report = capsys.readouterr().out
    assert "ddp restarted whole, failures" in report and "committed samples/s" in report
