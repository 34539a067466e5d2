"""strategy='ddp_ft' driven by a hand-written Cohort loop: two replica groups (one process each), a lighthouse in this
process; group 1 is killed with SIGKILL after a committed step, restarted, and heals from group 0's live state."""

from __future__ import annotations

import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from ft_harness import GroupLife, check_exit_codes, group_environment, group_results, import_script, script_life, stop

pytest.importorskip("torchft")

GROUPS = 2
KILLED = 1
KILL_AFTER = "committed step 1"


def _start(out: Path, group: int, life: int, lighthouse: str, later: bool = False) -> GroupLife:
    """Start one life of a replica group (``later``: it joins when a line arrives on its stdin); its output goes to a
    log."""
    environment = group_environment(group, GROUPS, lighthouse, START_ON_STDIN="1" if later else "0")
    return script_life(out, "ft_cohort_job.py", group, life, environment, stdin=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One Cohort run of GROUPS groups in which group KILLED is killed after a committed step and restarted; and the
    one-process reference of the same committed steps."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_cohort")
    # Quorums of all the groups only: after the kill the survivor waits (bounded) for the restarted group.
    with start_lighthouse(min_replicas=GROUPS, join_timeout=timedelta(milliseconds=200)) as lighthouse:
        lives = [_start(out, group, 0, lighthouse.address) for group in range(GROUPS)]
        # The restarted life is a new process, started now so that it has imported torch and phalanx by the kill.
        restarted = _start(out, KILLED, 1, lighthouse.address, later=True)
        lives.append(restarted)
        try:
            killed = lives[KILLED]
            killed.wait_for(f"^{re.escape(KILL_AFTER)}$")
            killed.process.send_signal(signal.SIGKILL)
            killed.wait()
            restarted.send("join")
            codes = [life.wait() for life in lives]
        finally:
            stop(lives)
    check_exit_codes(out, codes, [0, -signal.SIGKILL, 0])
    ft_cohort_job = import_script("ft_cohort_job")
    return {
        "results": group_results(out, GROUPS),
        "reference": ft_cohort_job.reference(GROUPS),
        "steps": ft_cohort_job.STEPS,
        "batch": ft_cohort_job.BATCH,
        "restart_log": restarted.log.read_text(),
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
