"""The checkpoint benchmarks run end to end on tiny states, so that a change to the library cannot leave them broken
until someone next needs their figures (``bench/RESULTS.md`` records the real runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

RUNS = [
    (
        ["bench/bench_checkpoint_io.py", "--gib", "0.01", "--repeats", "1"],
        [r"torch\.save \(this tree\) +[\d.]+ s", r"phalanx load \(this tree\) +[\d.]+ s", r"blocked [\d.]+ s"],
    ),
    (
        ["bench/bench_resume.py", "--mib", "16", "--repeats", "1"],
        [r"fit, resumed +[\d.]+ s \| peak above", r"resuming adds [\d.-]+ s to a fit: [\d.-]+x loading by hand"],
    ),
    (
        ["bench/bench_sharded_checkpoint.py", "--mib", "16", "--repeats", "1"],
        [r"save: dcp [\d.]+ s \| phalanx [\d.]+ s \| ratio [\d.]+ \| rank 0's peak memory", r"load: dcp [\d.]+ s"],
    ),
]


@pytest.mark.parametrize(("command", "expected"), RUNS, ids=[Path(run[0][0]).stem for run in RUNS])
def test_a_checkpoint_benchmark_runs_and_prints_its_figures(tmp_path, command, expected):
    environment = dict(os.environ, BENCH_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    finished = subprocess.run(
        [sys.executable, *command], cwd=ROOT, capture_output=True, text=True, env=environment, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    for pattern in expected:
        assert re.search(pattern, finished.stdout), f"{pattern!r} not in:\n{finished.stdout}"
    assert list(tmp_path.iterdir()) == [], "the benchmark left files behind"
