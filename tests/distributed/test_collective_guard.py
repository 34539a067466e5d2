"""Every collective Cohort method fails on every rank that reached it, naming the cause, when the ranks do not agree:
a method called on some ranks only (`if cohort.is_global_zero: cohort.save(...)`), different methods, different
arguments (broadcast's src, a path, the checkpoint behind one path, the module set up), a rank that exited, a rank
stalled elsewhere; each wait within the timeout given, instead of the process group's 30 minutes. Jobs (2 ranks):
scripts/collective_guard_job.py and scripts/cohort_agreement_job.py; the protocol itself is tested with threads in
tests/unit/cohort/test_cohort_agreement.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, run_script

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

#: The waits these jobs end in, in seconds (rank 0 waits that long for a rank that never comes). Both ranks reach the
#: collectives before them (set-up) together, right after the rendezvous, which no timeout bounds; the messages name
#: the value, so it is a parameter of the test, not of what it asserts. (It was 10 s: the four jobs idled 40 s.)
WAIT = 5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_on_rank_zero_alone_fails_fast_naming_the_method_and_the_missing_rank(tmp_path, strategy):
    # Rank 1 never reaches a collective here (it sleeps), so only rank 0 can tell; the job is then ended by us.
    env = clean_environment(PHALANX_COHORT_AGREEMENT_TIMEOUT=str(WAIT))
    command = [sys.executable, str(SCRIPTS / "collective_guard_job.py"), str(tmp_path), strategy, "alone"]
    job = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    report = tmp_path / "rank0.txt"
    try:
        deadline = time.monotonic() + 120  # process start and setup under load, then the agreement wait
        while not report.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.5)
        time.sleep(0.5)  # the file is written in one call; let it land
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    message = report.read_text()
    assert (
        "Cohort.save must be called on every rank" in message and f"rank 1 did not reach it within {WAIT} s" in message
    )
    assert not (tmp_path / "state.ckpt").exists()  # nothing written by the half-called save


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_at_different_collective_methods_both_fail_naming_them(tmp_path, strategy):
    job = run_script("collective_guard_job.py", str(tmp_path), strategy, "other", timeout=150)
    assert job.returncode != 0
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "different collective Cohort methods" in message
        assert "'save'" in message and "'barrier'" in message


JOB_BOUND = 240  # seconds: process start under load, then waits of at most TIMEOUT each (the 5-30 minutes they were)


def _agreement_job(tmp_path_factory, mode: str, timeout: str = "20") -> dict[int, dict]:
    out = tmp_path_factory.mktemp(mode)
    env = clean_environment(TIMEOUT=timeout)
    assert_ok(run_script("cohort_agreement_job.py", str(out), mode, env=env, timeout=JOB_BOUND))
    return {rank: json.loads(path.read_text()) for rank in (0, 1) if (path := out / f"{mode}{rank}.json").exists()}


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory):
    return _agreement_job(tmp_path_factory, "disagree")


# Each row: a case of scripts/cohort_agreement_job.py's 'disagree' mode, and what both ranks' error must say.
DISAGREEMENTS = [
    ("setup", ["Cohort.setup was called with different arguments", "parameters: 2 tensors", "same module"]),
    ("broadcast", ["Cohort.broadcast was called with different arguments", "src: 0 on rank 0; 1 on rank 1"]),
    ("save", ["Cohort.save was called with different arguments", "rank0.ckpt on rank 0;", "rank1.ckpt on rank 1"]),
    ("method", ["different collective Cohort methods", "{0: 'save', 1: 'barrier'}"]),
    ("load", ["Cohort.load was called with different arguments", "checkpoint: a file of", "same checkpoint"]),
    ("load-missing", ["Cohort.load was called with different arguments", "nothing at this path on rank 1"]),
    ("load_raw", ["Cohort.load_raw was called with different arguments", "checkpoint: a file of"]),
]


@pytest.mark.parametrize(("case", "said"), DISAGREEMENTS, ids=[row[0] for row in DISAGREEMENTS])
def test_ranks_that_disagree_all_fail_at_once_naming_the_difference(disagreeing, case, said):
    errors = [disagreeing[rank][case]["error"] for rank in (0, 1)]
    assert errors[0] is not None and errors[0] == errors[1], errors
    for text in said:
        assert text in errors[0]


def test_after_disagreements_the_ranks_agree_and_the_store_keys_stay_bounded(disagreeing):
    for rank in (0, 1):
        result = disagreeing[rank]
        assert result["agreed-broadcast"] == "from 1"
        assert result["agreed-load"]["error"] is None
        assert result["keys-after"] <= result["keys-before"] + 1  # 200 barriers later (each added 2 keys before)


@pytest.fixture(scope="module")
def after_an_exit(tmp_path_factory):
    return _agreement_job(tmp_path_factory, "exited")[0]


# Each row: a collective rank 0 calls after rank 1 exited, and what its error must say. The store agreement names the
# rank that exited; all_reduce / all_gather (not agreed: loops call them every step) fail on the transport's news.
AFTER_EXIT = [
    ("barrier", "Cohort.barrier cannot complete: rank 1 (after 2 collective Cohort call(s)) exited"),
    ("broadcast", "Cohort.broadcast cannot complete: rank 1 (after 2 collective Cohort call(s)) exited"),
    ("save", "Cohort.save cannot complete: rank 1 (after 2 collective Cohort call(s)) exited"),
    ("load", "Cohort.load cannot complete: rank 1 (after 2 collective Cohort call(s)) exited"),
    ("load_raw", "Cohort.load_raw cannot complete: rank 1 (after 2 collective Cohort call(s)) exited"),
    ("all_reduce", "The collective 'all_reduce(mean)' on rank 0 failed because another process left the job"),
    ("all_gather", "The collective 'all_gather' on rank 0 failed because another process left the job"),
]


@pytest.mark.parametrize(("case", "said"), AFTER_EXIT, ids=[row[0] for row in AFTER_EXIT])
def test_every_collective_names_a_rank_that_exited(after_an_exit, case, said):
    error = after_an_exit[case]["error"]
    assert error is not None and said in error, error


@pytest.fixture(scope="module")
def with_a_stalled_rank(tmp_path_factory):
    return _agreement_job(tmp_path_factory, "stalled", timeout=str(WAIT))[0]


# Each row: a collective rank 0 calls while rank 1 is alive elsewhere, with the strategy's timeout= of WAIT s.
STALLED = [
    ("barrier", f"the strategy's timeout= ({WAIT} s), as for the collective itself"),  # before: the store's 5 minutes
    ("save", f"the strategy's timeout= ({WAIT} s), shorter than PHALANX_COHORT_AGREEMENT_TIMEOUT"),  # before: 120 s
]


@pytest.mark.parametrize(("case", "source"), STALLED, ids=[row[0] for row in STALLED])
def test_a_wait_for_a_stalled_rank_honours_the_timeout_given(with_a_stalled_rank, case, source):
    error = with_a_stalled_rank[case]["error"]
    assert error is not None
    assert f"Cohort.{case} must be called on every rank, but rank 1 did not reach it within {WAIT} s" in error
    assert f"The wait is set by {source}." in error
