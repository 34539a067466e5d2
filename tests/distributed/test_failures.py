"""A failing, killed or stuck rank never hangs the job: every process exits non-zero, soon, with one traceback."""

from __future__ import annotations

import sys
import time
import uuid

import pytest
from phalanx_distributed import clean_environment, processes_with_marker, run_script


def _no_process_left(marker: str) -> bool:
    deadline = time.monotonic() + 3
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not processes_with_marker(marker)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(strategy, rank) -> a job in which that rank killed itself at step 3, its marker, when it ended and the file
    holding when the rank died: each such job runs once, for both tests that read it."""
    jobs: dict[tuple[str, int], tuple] = {}

    def get(strategy: str, failing_rank: int) -> tuple:
        if (strategy, failing_rank) not in jobs:
            marker, stamp = f"marker-{uuid.uuid4().hex}", tmp_path_factory.mktemp("killed") / "killed_at"
            environment = clean_environment(KILL_STAMP=str(stamp))
            args = (strategy, str(failing_rank), "kill", "120", marker)
            job = run_script("failing_job.py", *args, env=environment, timeout=60)
            jobs[strategy, failing_rank] = (job, marker, time.time(), stamp)
        return jobs[strategy, failing_rank]

    return get


# The collective timeout is 120 s here: the job must end because phalanx stops it, not because torch gives up.
@pytest.mark.parametrize(
    ("strategy", "failing_rank", "mode"),
    [
        ("ddp", 1, "raise"),
        ("ddp", 0, "raise"),
        ("ddp", 1, "kill"),
        ("ddp", 0, "kill"),
        ("ddp_spawn", 1, "raise"),
        ("ddp_fork", 1, "kill"),
    ],
)
def test_a_failing_rank_stops_the_whole_job(killed, strategy, failing_rank, mode):
    if mode == "kill":
        job, marker, _, _ = killed(strategy, failing_rank)
    else:
        marker = f"marker-{uuid.uuid4().hex}"
        job = run_script("failing_job.py", strategy, str(failing_rank), mode, "120", marker, timeout=60)
    assert job.returncode != 0
    assert job.seconds < 30, f"the job took {job.seconds:.1f} s to stop"
    assert _no_process_left(marker)
    if mode == "raise":
        assert f"deliberate failure on rank {failing_rank}" in job.stderr
        if strategy == "ddp":
            assert job.stderr.count("Traceback") == 1, job.stderr
    else:
        assert job.stderr.count("Traceback") <= 1, job.stderr


def test_a_stuck_rank_ends_in_a_timeout_that_names_the_operation_and_the_remedy():
    marker = f"marker-{uuid.uuid4().hex}"
    job = run_script("failing_job.py", "ddp", "1", "hang", "3", marker, timeout=60)
    assert job.returncode != 0
    assert "timed out" in job.stderr and "on rank 0" in job.stderr and "timeout=" in job.stderr
    assert job.seconds < 30
    assert _no_process_left(marker)


def test_spawn_without_main_guard_fails_with_a_clear_message():
    job = run_script("unguarded_spawn.py", timeout=60)
    assert job.returncode != 0
    assert 'if __name__ == "__main__":' in job.stderr
    assert sys.executable  # the job ended by itself well before the helper's timeout


# Nothing is logged with sync_dist in this job: the stall is noticed inside the collectives torch's wrappers run on
# their own, which gloo reports as "Timed out waiting 3000ms for recv"; phalanx names the operation instead.
@pytest.mark.parametrize(
    ("strategy", "point", "operation"),
    [
        ("ddp", "forward", "DDP gradient all-reduce (backward)"),
        ("ddp", "backward", "DDP gradient all-reduce (backward)"),
        ("fsdp", "forward", "FSDP parameter all-gather"),
        ("fsdp", "backward", "FSDP parameter all-gather and gradient reduce-scatter (backward)"),
    ],
)
def test_a_rank_stalled_in_the_wrappers_collectives_is_reported_by_operation_rank_and_timeout(
    strategy, point, operation
):
    marker = f"marker-{uuid.uuid4().hex}"
    job = run_script("stalled_rank_job.py", strategy, point, "3", marker, timeout=90)
    assert job.returncode != 0
    assert "CollectiveError" in job.stderr, job.stderr[-3000:]
    assert f"The collective '{operation}" in job.stderr and "on rank 0 timed out after 0:00:03" in job.stderr
    assert "timeout= argument" in job.stderr
    assert job.seconds < 40
    assert _no_process_left(marker)


def test_a_rank_that_starts_later_than_the_collective_timeout_still_joins():
    # A short timeout= is for catching stalled collectives; slow process start-up (importing torch on a loaded
    # machine) must not fail the rendezvous.
    marker = f"marker-{uuid.uuid4().hex}"
    job = run_script("stalled_rank_job.py", "ddp", "start", "3", marker, timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    assert _no_process_left(marker)


@pytest.mark.parametrize(("strategy", "failing_rank"), [("ddp", 1), ("ddp", 0), ("ddp_fork", 1)])
def test_a_killed_rank_ends_the_job_within_seconds_with_no_process_left(killed, strategy, failing_rank):
    job, marker, ended, stamp = killed(strategy, failing_rank)
    assert job.returncode != 0
    # A liveness bound, generous for a loaded machine: without the launcher's watch the job would wait for the timeout.
    assert ended - float(stamp.read_text()) < 5.0, (
        f"the job ended {ended - float(stamp.read_text()):.2f} s after rank {failing_rank} was killed"
    )
    assert _no_process_left(marker)
