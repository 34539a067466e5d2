"""strategy='ddp_ft' driven by a hand-written Cohort loop: two replica groups (one process each), a lighthouse in this
process; group 1 is killed with SIGKILL after a committed step, restarted, and heals from group 0's live state."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
from phalanx_distributed import SCRIPTS, clean_environment, free_port

pytest.importorskip("torchft")

GROUPS = 2
KILLED = 1
KILL_AFTER = "committed step 1"
WAIT_S = 240  # bound on every wait of the fixture: a hang fails the test instead of blocking CI


def _start(
    out: Path, group: int, life: int, lighthouse: str, later: bool = False
) -> tuple[subprocess.Popen[str], threading.Event, Path]:
    """Start one life of a replica group (``later``: it joins when a line arrives on its stdin); the event is set when
    it prints KILL_AFTER (its output goes to a log)."""
    environment = clean_environment(
        START_ON_STDIN="1" if later else "0",
        REPLICA_GROUP_ID=str(group),
        NUM_REPLICA_GROUPS=str(GROUPS),
        TORCHFT_LIGHTHOUSE=lighthouse,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    command = [sys.executable, str(SCRIPTS / "ft_cohort_job.py"), str(out)]
    process = subprocess.Popen(
        command,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    seen, log = threading.Event(), out / f"group{group}.life{life}.log"

    def copy(stream: IO[str]) -> None:
        with log.open("w") as file:
            for line in stream:
                file.write(line)
                file.flush()
                if line.strip() == KILL_AFTER:
                    seen.set()

    assert process.stdout is not None
    threading.Thread(target=copy, args=(process.stdout,), daemon=True).start()
    return process, seen, log


def _wait_for(seen: threading.Event, process: subprocess.Popen[str]) -> None:
    """Until ``seen`` is set, the process ends (a failed job: no need to wait on) or WAIT_S pass."""
    deadline = time.monotonic() + WAIT_S
    while not seen.wait(timeout=1.0) and process.poll() is None and time.monotonic() < deadline:
        pass
    seen.wait(timeout=1.0)  # its output's last lines may still be on their way to the log


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One Cohort run of GROUPS groups in which group KILLED is killed after a committed step and restarted; and the
    one-process reference of the same committed steps."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_cohort")
    # Quorums of all the groups only: after the kill the survivor waits (bounded) for the restarted group.
    with start_lighthouse(min_replicas=GROUPS, join_timeout=timedelta(milliseconds=200)) as lighthouse:
        started = [_start(out, group, 0, lighthouse.address) for group in range(GROUPS)]
        # The restarted life is a new process, started now so that it has imported torch and phalanx by the kill.
        restarted, _, restart_log = _start(out, KILLED, 1, lighthouse.address, later=True)
        processes = [process for process, _, _ in started] + [restarted]
        try:
            killed, seen, first_log = started[KILLED]
            _wait_for(seen, killed)
            assert seen.is_set(), f"group {KILLED} never printed {KILL_AFTER!r}: {first_log.read_text()}"
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=WAIT_S)
            assert restarted.stdin is not None
            restarted.stdin.write("join\n")
            restarted.stdin.flush()
            codes = [process.wait(timeout=WAIT_S) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
    logs = {log.name: log.read_text()[-6000:] for log in sorted(out.glob("*.log"))}
    assert codes == [0, -signal.SIGKILL, 0], f"exit codes {codes}; logs: {logs}"
    sys.path.insert(0, str(SCRIPTS))
    try:
        import ft_cohort_job
    finally:
        sys.path.remove(str(SCRIPTS))
    return {
        "results": [json.loads((out / f"group{group}.json").read_text()) for group in range(GROUPS)],
        "reference": ft_cohort_job.reference(GROUPS),
        "steps": ft_cohort_job.STEPS,
        "batch": ft_cohort_job.BATCH,
        "restart_log": restart_log.read_text(),
        "checkpoint": out / "cohort.ckpt",
    }


def _max_difference(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def test_every_group_ends_with_the_weights_of_one_process_on_the_combined_committed_batches(run):
    for group, result in enumerate(run["results"]):
        assert _max_difference(result["weights"], run["reference"]) < 1e-6, f"group {group} differs"
        assert result["global_step"] == run["steps"]  # committed steps only


def test_committed_steps_train_each_sample_of_the_groups_shares_once_across_the_kill(run):
    committed = [[index for batch in result["committed"] for index in batch] for result in run["results"]]
    assert [len(indices) for indices in committed] == [run["steps"] * run["batch"]] * GROUPS
    assert all(len(set(indices)) == len(indices) for indices in committed)
    assert set.union(*map(set, committed)) == set(range(run["steps"] * run["batch"] * GROUPS))


def test_the_killed_group_heals_from_a_peer_with_the_registered_position(run):
    log = run["restart_log"]
    healed = re.search(r"healed from a peer \(no checkpoint read\).*continues at global_step=(\d+), step=(\d+)", log)
    assert healed, log[-3000:]
    global_step, step = int(healed.group(1)), int(healed.group(2))
    assert global_step == step >= 1  # the survivor's counters, not the fresh process's 0
    assert "committed step 1\n" not in log  # it never retrained the steps before its position


def test_cohort_save_and_load_on_group_zero_round_trip_the_final_state(run):
    import torch

    loaded = run["results"][0]["loaded"]
    assert loaded["position"] == {"step": run["steps"]} and loaded["step"] == run["steps"]
    assert _max_difference(loaded["weights"], run["reference"]) < 1e-6
    checkpoint = torch.load(run["checkpoint"], weights_only=False)
    assert checkpoint["global_step"] == run["steps"] and "loaded" not in run["results"][1]
