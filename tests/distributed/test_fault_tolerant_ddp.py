"""strategy='ddp_ft' across real replica groups (one process each) and a lighthouse in this process; group 1 is killed
with SIGKILL mid-run and restarted, and rejoins from group 0's live state: weights, optimizer state, LR scheduler state,
callbacks' states and loop position. Every group is killed after a save, and the restart of all with ckpt_path="auto"
goes on from the newest checkpoint."""

from __future__ import annotations

import math
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from ft_harness import (
    GroupLife,
    check_exit_codes,
    group_environment,
    group_results,
    import_script,
    logs,
    script_life,
    stop,
)

pytest.importorskip("torchft")

GROUPS = 2
KILLED = 1  # the group killed ...
KILL_AFTER = "committed step 1"  # ... once it printed this line


def _start(out: Path, group: int, life: int, lighthouse: str, **extra: str) -> GroupLife:
    """Start one life of a replica group (scripts/ft_group_job.py; its output goes to a log)."""
    environment = group_environment(group, GROUPS, lighthouse, **extra)
    return script_life(out, "ft_group_job.py", group, life, environment)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One fault-tolerant run of GROUPS groups (the Trainer's defaults otherwise) in which group KILLED is killed after
    a committed step and restarted; and the one-process reference of the same committed steps."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft")
    # The lighthouse forms quorums of all the groups only: after the kill the survivor's next step waits (bounded by
    # its quorum_timeout) for the restarted group, so that the rejoin happens before the survivor could finish.
    with start_lighthouse(min_replicas=GROUPS, join_timeout=timedelta(milliseconds=200)) as lighthouse:
        lives = [_start(out, group, 0, lighthouse.address) for group in range(GROUPS)]
        killed = lives[KILLED]
        try:
            killed.wait_for(f"^{re.escape(KILL_AFTER)}$")
            killed.process.send_signal(signal.SIGKILL)
            killed_code = killed.wait()
            lives[KILLED] = restarted = _start(out, KILLED, 1, lighthouse.address)
            codes = [life.wait() for life in lives]
        finally:
            stop([*lives, killed])
    check_exit_codes(out, codes, [0] * GROUPS)
    ft_group_job = import_script("ft_group_job")
    return {
        "results": group_results(out, GROUPS),
        "reference": ft_group_job.reference_fit(GROUPS, out / "reference"),
        "steps": ft_group_job.STEPS,
        "batch": ft_group_job.BATCH,
        "lr_step": ft_group_job.LR_STEP,
        "killed_code": killed_code,
        "restart_log": restarted.log.read_text(),
    }


def test_every_group_ends_with_the_weights_of_one_process_on_the_combined_batches(run):
    for group, result in enumerate(run["results"]):
        for got, want in zip(result["weights"], run["reference"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"group {group} differs from the reference"


def test_every_group_ends_on_the_schedule_of_the_committed_steps(run):
    # StepLR(step_size=LR_STEP, gamma=0.5) from Net's lr=0.05, stepped once per committed step on every group.
    final = [result["final_state"] for result in run["results"]]
    for state in final:
        assert state["scheduler"]["last_epoch"] == run["steps"], state
        assert state["lr"] == pytest.approx(0.05 * 0.5 ** (run["steps"] // run["lr_step"])), state
    assert all(state["scheduler"] == final[0]["scheduler"] for state in final[1:]), final


def test_the_restarted_group_steps_at_its_peers_learning_rate_from_the_heal_on(run):
    survivor, restarted = (result["states"] for result in run["results"])
    assert restarted and set(restarted) <= set(survivor), (sorted(restarted), sorted(survivor))
    for step, state in restarted.items():
        assert (state["lr"], state["scheduler"]) == (survivor[step]["lr"], survivor[step]["scheduler"]), step


def test_the_restarted_group_receives_its_peers_callback_states(run):
    survivor, restarted = (result["states"] for result in run["results"])
    healed_at = min(restarted, key=int)
    want, got = survivor[healed_at], restarted[healed_at]
    # The peer had validated and saved by then: these are not the states of a group that just started.
    assert want["best_k_models"] and want["best_score"] is not None and math.isfinite(want["best_score"]), want
    for key in ("wait_count", "best_score", "best_model_score", "best_k_models"):
        assert got[key] == want[key], (key, got, want)


def test_global_step_counts_the_committed_steps(run):
    assert [result["global_step"] for result in run["results"]] == [run["steps"]] * GROUPS


def test_committed_steps_train_each_sample_of_the_groups_shares_once_across_the_kill(run):
    # The killed group's file holds the batches of both its lives: before the kill, and from the healed position on.
    committed = [[index for batch in result["committed"] for index in batch] for result in run["results"]]
    assert [len(indices) for indices in committed] == [run["steps"] * run["batch"]] * GROUPS
    assert all(len(set(indices)) == len(indices) for indices in committed)
    assert not set.intersection(*map(set, committed))
    assert set.union(*map(set, committed)) == set(range(run["steps"] * run["batch"] * GROUPS))


def test_the_killed_group_rejoins_from_a_peer_at_its_position(run):
    assert run["killed_code"] == -signal.SIGKILL
    healed = re.search(
        r"healed from a peer \(no checkpoint read\): weights, optimizer state, the state of 1 learning-rate"
        r" scheduler\(s\), the states of (\d+) callback\(s\) and loop position received; it continues at"
        r" global_step=(\d+)",
        run["restart_log"],
    )
    assert healed, run["restart_log"][-3000:]
    assert int(healed.group(1)) >= 2  # at least EarlyStopping's and the top-k ModelCheckpoint's
    assert int(healed.group(2)) >= 1  # the survivor's step, not the fresh process's 0
    assert "committed step 1\n" not in run["restart_log"]  # it never retrained the steps before its position


def test_only_group_zero_writes_checkpoints(run):
    assert [result["is_global_zero"] for result in run["results"]] == [True] + [False] * (GROUPS - 1)
    assert run["results"][0]["checkpoints"] and not any(result["checkpoints"] for result in run["results"][1:])


MISSED = 2  # steps group 0 commits while group 1 is stalled (alive)


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """3 groups, quorums of any 2 or more (the lighthouse wants more than half of the live groups): group 1 stalls while
    groups 0 and 2 commit MISSED steps without it, then all go on (scripts/ft_group_job.py's SlowGroup)."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_slow")
    # A quorum forms without a heartbeating group that did not ask within the join timeout (the stalled one).
    with start_lighthouse(min_replicas=1, join_timeout=timedelta(seconds=2)) as lighthouse:
        slow = {"PHALANX_FT_SLOW": str(MISSED), "NUM_REPLICA_GROUPS": "3"}
        lives = [_start(out, group, 0, lighthouse.address, **slow) for group in range(3)]
        try:
            codes = [life.wait() for life in lives]
        finally:
            stop(lives)
    check_exit_codes(out, codes, [0, 0, 0])
    return {"results": group_results(out, 3), "logs": logs(out)}


def test_a_slow_group_takes_its_peers_loop_position_and_ends_with_them(slow_run):
    fast, slow, other = slow_run["results"]
    assert fast["global_step"] == slow["global_step"] == other["global_step"] == 6
    # Group 1 trained MISSED steps fewer (its share of the steps it missed is skipped): in the first epoch (4 batches
    # a group) the batch before its stall and the one in hand, which trained in the peers' step; it ended that epoch
    # with them, and read the next one from its start.
    assert [len(fast["committed"]), len(slow["committed"]), len(other["committed"])] == [6, 6 - MISSED, 6]
    first_epoch = slow["committed"][: 4 - MISSED]
    assert len({index for batch in first_epoch for index in batch}) == 4 * (4 - MISSED)
    assert slow["committed"][4 - MISSED :] == first_epoch
    caught_up = re.search(
        r"took their weights, optimizer state, .* and loop counters during a step.*global_step=(\d+)",
        slow_run["logs"]["group1.life0.log"],
    )
    assert caught_up and int(caught_up.group(1)) == 1 + MISSED, slow_run["logs"]["group1.life0.log"][-3000:]
    # Every step after the catch-up had all groups: they end with the same weights (none trained on alone at the end).
    for got, want in zip(slow["weights"], fast["weights"]):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6
    # It took their scheduler's state too: it steps the learning rate of the committed steps, not of its own steps.
    assert slow["final_state"]["scheduler"] == fast["final_state"]["scheduler"] == other["final_state"]["scheduler"]


# Every group is killed while it waits after committing step HOLD_AT, before that step's validation: the newest
# complete checkpoint is SAVED's (the run validates, and its ModelCheckpoints save, after every step).
HOLD_AT = 3
SAVED = HOLD_AT - 1


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every group killed (SIGKILL) after committing step HOLD_AT, the checkpoints of step SAVED complete; then all
    restarted with ckpt_path="auto" (scripts/ft_group_job.py's callbacks: the default ModelCheckpoint in the group's
    folder, a top-k one in a folder all groups name, where group 0 alone writes)."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_auto")
    # The lighthouse outlives the groups; it forgets the killed ones 1 s after their last heartbeat (until then it would
    # count them as live groups of the run, and wait for them).
    ticks = {"join_timeout": timedelta(milliseconds=200), "heartbeat_timeout": timedelta(seconds=1)}
    with start_lighthouse(min_replicas=GROUPS, **ticks) as lighthouse:
        hold = {"PHALANX_FT_HOLD_AT": str(HOLD_AT)}
        first = [_start(out, group, 0, lighthouse.address, **hold) for group in range(GROUPS)]
        second: list[GroupLife] = []
        try:
            for life in first:
                life.wait_for(f"^holding after committed step {HOLD_AT}$")
            for life in first:
                life.process.send_signal(signal.SIGKILL)
            killed_codes = [life.wait() for life in first]
            resume = {"PHALANX_FT_CKPT_PATH": "auto"}
            second = [_start(out, group, 1, lighthouse.address, **resume) for group in range(GROUPS)]
            codes = [life.wait() for life in second]
        finally:
            stop([*first, *second])
    check_exit_codes(out, codes, [0] * GROUPS)
    ft_group_job = import_script("ft_group_job")
    return {
        "results": group_results(out, GROUPS),
        "reference": ft_group_job.reference_fit(GROUPS, out / "reference"),
        "steps": ft_group_job.STEPS,
        "batch": ft_group_job.BATCH,
        "killed_codes": killed_codes,
        "logs": {life.log.name: life.log.read_text() for life in second},
    }


def test_after_every_group_died_auto_resumes_from_the_newest_checkpoint(auto_run):
    assert auto_run["killed_codes"] == [-signal.SIGKILL] * GROUPS
    group0, group1 = (auto_run["logs"][f"group{group}.life1.log"] for group in range(GROUPS))
    found = r"ckpt_path='auto': resuming from (\S+) \(global step (\d+)"
    resumed = [re.search(found, group0), re.search(found, group1)]
    assert [int(match.group(2)) if match else None for match in resumed] == [SAVED, SAVED], (group0, group1)
    # Group 1 wrote no checkpoint: it finds group 0's newest in the folder all groups name; at the first quorum it
    # then takes group 0's state live (torchft's first quorum syncs every group from group 0).
    assert resumed[1] is not None and Path(resumed[1].group(1)).parent.name == "best"
    healed = re.search(r"healed from a peer \(no checkpoint read\).*continues at global_step=(\d+)", group1)
    assert healed and int(healed.group(1)) == SAVED, group1[-3000:]


def test_after_every_group_died_auto_ends_like_the_uninterrupted_run_on_the_committed_batches(auto_run):
    steps, batch = auto_run["steps"], auto_run["batch"]
    for group, result in enumerate(auto_run["results"]):
        assert result["global_step"] == steps
        for got, want in zip(result["weights"], auto_run["reference"], strict=True):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"group {group} differs from the reference"
        # Life 0 committed steps 1 to HOLD_AT; life 1 trained again from the step after the checkpoint, on the same
        # batches, to the end.
        first, second = result["committed"][:HOLD_AT], result["committed"][HOLD_AT:]
        assert len(second) == steps - SAVED and second[: HOLD_AT - SAVED] == first[SAVED:]
    counted = [index for result in auto_run["results"] for step in result["committed"][:SAVED] for index in step]
    counted += [index for result in auto_run["results"] for step in result["committed"][HOLD_AT:] for index in step]
    assert sorted(counted) == list(range(steps * batch * GROUPS))  # every sample of the committed steps once
