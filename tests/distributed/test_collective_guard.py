"""A collective Cohort method called on some ranks only (`if cohort.is_global_zero: cohort.save(...)`) fails within
the agreement timeout with the cause, instead of hanging until the process group's 30-minute timeout. Job:
scripts/collective_guard_job.py, 2 ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from phalanx_distributed import SCRIPTS, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_on_rank_zero_alone_fails_fast_naming_the_method_and_the_missing_rank(tmp_path, strategy):
    # Rank 1 never reaches a collective here (it sleeps), so only rank 0 can tell; the job is then ended by us.
    env = clean_environment(PHALANX_COHORT_AGREEMENT_TIMEOUT="10")
    command = [sys.executable, str(SCRIPTS / "collective_guard_job.py"), str(tmp_path), strategy, "alone"]
    job = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    report = tmp_path / "rank0.txt"
    try:
        deadline = time.monotonic() + 120  # process start and setup under load, then the 10 s agreement wait
        while not report.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.5)
        time.sleep(0.5)  # the file is written in one call; let it land
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    message = report.read_text()
    assert "Cohort.save must be called on every rank" in message and "rank(s) [1]" in message
    assert not (tmp_path / "state.ckpt").exists()  # nothing written by the half-called save


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_at_different_collective_methods_both_fail_naming_them(tmp_path, strategy):
    job = run_script("collective_guard_job.py", str(tmp_path), strategy, "other", timeout=150)
    assert job.returncode != 0
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "different collective Cohort methods" in message
        assert "'save'" in message and "'barrier'" in message
