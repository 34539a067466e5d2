"""The chaos tier of strategy='ddp_ft': 3 replica groups of one process while a supervisor kills a random group
(SIGKILL, at random points of a step, a save or a heal) every few seconds and restarts it.

The schedule is drawn from a seeded generator; the seed is printed, and PHALANX_CHAOS_SEED replays it. CI runs a short
schedule (kills at random steps, some of them of a group that is healing); a longer one for local runs:
PHALANX_CHAOS_STEPS (default 60) and PHALANX_CHAOS_KILLS (default 3).
"""

from __future__ import annotations

import os
import random
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from ft_harness import group_results, import_script

pytest.importorskip("torchft")

ft_chaos, ft_chaos_job = import_script("ft_chaos"), import_script("ft_chaos_job")
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import bench_fault_tolerance
finally:
    sys.path.remove(str(BENCH))

STEPS = int(os.environ.get("PHALANX_CHAOS_STEPS", "60"))
KILLS = int(os.environ.get("PHALANX_CHAOS_KILLS", "3"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One chaos run; its groups' journals split into lives; its final results."""
    seed = int(os.environ.get("PHALANX_CHAOS_SEED", random.SystemRandom().randrange(2**31)))
    out = tmp_path_factory.mktemp("ft_chaos")
    deadline = 240 + 10 * STEPS + 30 * KILLS
    chaos = ft_chaos.run_chaos(out, STEPS, seed, KILLS, deadline)
    lives: dict[int, list[list[dict]]] = {}
    for group in range(3):
        lives[group] = []
        for record in ft_chaos.journal(out, group):
            if record["event"] == "start":
                lives[group].append([])
            lives[group][-1].append(record)
    return {"chaos": chaos, "lives": lives, "results": group_results(out, 3), "out": out}


def _attempts(run) -> dict[tuple[int, int], list[dict]]:
    """Every step attempt of every life, by (group, step)."""
    attempts = defaultdict(list)
    for group, lives in run["lives"].items():
        for life in lives:
            for record in life:
                if record["event"] == "attempt":
                    attempts[group, record["step"]].append(record)
    return attempts


def _commits(run) -> list[dict]:
    return [r for lives in run["lives"].values() for life in lives for r in life if r["event"] == "commit"]


def test_the_schedule_killed_groups_and_every_group_finished(run):
    chaos = run["chaos"]
    assert chaos.kills, f"no kill landed (seed {chaos.seed}): the run outpaced the schedule"
    assert [result["global_step"] for result in run["results"]] == [STEPS] * 3
    # Every planned kill landed, or came due only in the last steps (where a restarted group would find no peer).
    assert len(chaos.kills) + chaos.skipped == KILLS
    # Each kill ended a life that had started (its journal opened) and the restarted life took over its group.
    assert all(len(run["lives"][kill["group"]]) > kill["life"] for kill in chaos.kills)


def test_each_committed_step_had_every_group_and_one_batch_per_group(run):
    commits = _commits(run)
    assert {commit["step"] for commit in commits} == set(range(STEPS))
    assert {commit["participants"] for commit in commits} == {3}
    attempts = _attempts(run)
    for step in range(STEPS):
        for group in range(3):
            tried = attempts[group, step]
            assert tried, f"group {group} has no attempt of committed step {step} (seed {run['chaos'].seed})"
            # A retried step (declined, or a life that healed to it) reads the same batch as every earlier try.
            assert len({(r["epoch"], tuple(r["indices"])) for r in tried}) == 1, (step, group, tried)


def test_every_sample_of_each_epoch_is_trained_once_by_committed_steps(run):
    attempts, epochs = _attempts(run), defaultdict(list)
    for step in range(STEPS):
        for group in range(3):
            record = attempts[group, step][0]
            epochs[record["epoch"]] += record["indices"]
    samples = ft_chaos_job.samples(4)
    assert len(epochs) == STEPS // ft_chaos_job.BATCHES
    for epoch, indices in epochs.items():
        assert sorted(indices) == list(range(samples)), f"epoch {epoch} (seed {run['chaos'].seed})"


def test_final_weights_equal_one_process_replaying_the_committed_batches(run):
    attempts = _attempts(run)
    batches = [[i for group in range(3) for i in attempts[group, step][0]["indices"]] for step in range(STEPS)]
    reference = ft_chaos_job.replay(batches)
    for group, result in enumerate(run["results"]):
        for got, want in zip(result["weights"], reference):
            error = max(abs(a - b) for a, b in zip(got, want))
            assert error < 1e-6, f"group {group} differs from the replay by {error} (seed {run['chaos'].seed})"


def test_every_rejoin_healed_from_a_peer_and_no_checkpoint_was_read(run):
    for group, lives in run["lives"].items():
        for number, life in enumerate(lives[1:], start=1):
            events = [record["event"] for record in life]
            if "attempt" in events:  # a life killed before its first step may not have healed yet
                assert "heal" in events[: events.index("attempt")], f"group {group} life {number}: {events[:8]}"
        assert not any(record["event"] == "checkpoint read" for life in lives for record in life)


def test_a_kill_during_a_save_leaves_only_complete_checkpoints(run):
    saved = sorted((run["out"] / "group0" / "checkpoints").glob("*.ckpt"))
    assert saved
    for path in saved:
        assert torch.load(path, weights_only=False)["global_step"] > 0, path


def test_the_bench_times_each_restart_that_healed_and_committed_by_part(run):
    # bench/bench_fault_tolerance.py reads the same journals; its smoke test runs the ddp baseline only.
    summary = bench_fault_tolerance.summarize_ft(run["out"], run["chaos"], batch=4)
    healed = sum(
        1
        for lives in run["lives"].values()
        for life in lives[1:]
        if {"transfer end", "commit"} <= {record["event"] for record in life}
    )
    assert len(summary["restarts"]) == healed
    for parts in summary["restarts"]:
        named = [parts[name] for name, _ in bench_fault_tolerance.PARTS]
        assert min(named) >= 0 and abs(sum(named) - parts["total"]) < 1e-6, parts
    assert summary["samples_per_s"] > 0 and summary["kills"] == KILLS
