"""bench/bench_cohort_agreement.py runs end to end on 2 processes and a few calls, so that a change to the Cohort's
agreement cannot leave it broken until someone next needs its figures (``bench/RESULTS.md`` records the real runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from phalanx_distributed import clean_environment

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

ROOT = Path(__file__).resolve().parents[2]


def test_the_agreement_bench_runs_and_its_keys_stay_bounded():
    finished = subprocess.run(
        [sys.executable, "bench/bench_cohort_agreement.py", "--world-sizes", "2", "--calls", "100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    found = re.search(
        r"world 2: [\d.]+ us/call \| store operations per call, by rank: ([\d.]+), ([\d.]+)", finished.stdout
    )
    assert found, finished.stdout
    assert all(float(count) <= 5 for count in found.groups())  # four or five round trips per call, per rank
    keys = re.search(r"keys (\d+) -> (\d+)", finished.stdout)
    assert keys and int(keys.group(2)) <= int(keys.group(1)) + 1, finished.stdout
