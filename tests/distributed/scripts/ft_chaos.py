"""A chaos supervisor for 3 replica groups of ft_chaos_job.py: kills a random group's process, restarts it at once.

The random generator is seeded (the seed is printed), so a failing schedule replays: the same seed draws the same
steps, groups and delays (the points of a step they land on still vary with the machine's speed). Every wait is
bounded: a run that outlives ``deadline_s`` is killed and reported with its logs. Used by
tests/distributed/test_fault_tolerant_chaos.py and bench/bench_fault_tolerance.py.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ft_harness import GroupLife, group_environment, logs
from phalanx_distributed import SCRIPTS

JOB = SCRIPTS / "ft_chaos_job.py"


@dataclass
class Chaos:
    """What a chaos run did: its seed, each kill (time, group, life it ended) and each life's start time."""

    seed: int
    kills: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    skipped: int = 0  # planned kills left out because they came due in the last steps


class _Life(GroupLife):
    """One process of one replica group; follows the steps it committed and the milestones it reached."""

    def __init__(self, out: Path, group: int, life: int, command: list[str], environment: dict[str, str]) -> None:
        self.committed = 0
        self.milestones: set[str] = set()
        super().__init__(out, group, life, command, environment, on_line=self._read)

    def _read(self, line: str) -> None:
        if line.startswith("ready"):
            self.milestones.add("ready")
        elif line.startswith("committed step "):
            self.committed = int(line.split()[-1])
        elif line.startswith("milestone "):
            self.milestones.add(line[len("milestone ") :].strip())


def _start(out: Path, group: int, life: int, lighthouse: str, job_args: list[str]) -> _Life:
    environment = group_environment(group, 3, lighthouse, PHALANX_CHAOS_GO=str(out / "go"))
    return _Life(out, group, life, [sys.executable, str(JOB), str(out), *job_args], environment)


class _StepPlan:
    """Kills at random steps (a random delay after a step committed) and, at random, kills a restarted group again
    while it forms its first quorum and receives a peer's state."""

    def __init__(self, rng: random.Random, steps: int, kills: int) -> None:
        self.rng, self.steps = rng, steps
        thresholds = sorted(rng.sample(range(2, max(steps - 5, 3)), k=min(kills, max(steps - 7, 1))))
        # The delay after the threshold is a fraction of one step's duration (measured as the run goes), not seconds:
        # on a fast machine a fixed 0.3 s spanned dozens of steps and could land after the groups had finished.
        self.plan = [(at, rng.random(), rng.random() < 0.3) for at in thresholds]
        self.armed: float | None = None
        self.skipped = 0  # kills due after the last steps had started: a restarted group would find no peer left
        self._done, self._done_at, self._steps_s = 0, time.monotonic(), [0.05]

    def victim(self, lives: list[_Life], last: int | None) -> int | None:
        """The group to kill now, or None."""
        done = max(life.committed for life in lives)
        if done > self._done:
            now = time.monotonic()
            self._steps_s = [*self._steps_s[-4:], (now - self._done_at) / (done - self._done)]
            self._done, self._done_at = done, now
        if not self.plan:
            return None
        at, fraction, during_heal = self.plan[0]
        if during_heal and last is not None:
            ready = "quorum" in lives[last].milestones
        else:
            ready = done >= at
        if ready and self.armed is None:
            # The median of the last steps: a step that waited for a restarted group (tens of seconds) would put the
            # kill after the run's end.
            self.armed = time.monotonic() + fraction * sorted(self._steps_s)[len(self._steps_s) // 2]
        if self.armed is None or time.monotonic() < self.armed:
            return None
        self.plan.pop(0)
        self.armed = None
        if done >= self.steps - 3:
            self.skipped += 1
            return None
        return last if during_heal and last is not None else self.rng.randrange(3)


class _TimePlan:
    """Kills a random group every ``every_s`` seconds (uniform between the two) once training runs (for the bench)."""

    def __init__(self, rng: random.Random, every_s: tuple[float, float], kills: int, steps: int) -> None:
        self.rng, self.every_s, self.kills, self.steps = rng, every_s, kills, steps
        self.next: float | None = None
        self.done_at_kill = 0

    def victim(self, lives: list[_Life], last: int | None) -> int | None:
        done = max(life.committed for life in lives)
        # None in the last third: a group restarted then might only come up after its peers finished. None before a
        # step committed since the last kill: where restarts take longer than the interval, kills of groups still
        # restarting would leave too few groups for any quorum, and the run would never end.
        if self.kills <= 0 or done <= self.done_at_kill or done >= self.steps * 2 // 3:
            return None
        if self.next is None:
            self.next = time.monotonic() + self.rng.uniform(*self.every_s)
        if time.monotonic() < self.next:
            return None
        self.kills -= 1
        self.next, self.done_at_kill = time.monotonic() + self.rng.uniform(*self.every_s), done
        return self.rng.randrange(3)


def run_chaos(
    out: Path,
    steps: int,
    seed: int,
    max_kills: int = 3,
    deadline_s: float = 300.0,
    job_args: tuple[str, ...] = (),
    kill_every_s: tuple[float, float] | None = None,
    min_replicas: int = 3,
) -> Chaos:
    """Run 3 replica groups for ``steps`` steps, killing one (SIGKILL) ``max_kills`` times and restarting it at once.

    Kills come at random steps (``kill_every_s=None``) or every ``kill_every_s`` seconds; none in the last few steps:
    a group restarted after its peers finished would find no quorum to join. ``max_kills=0`` is the failure-free run.
    Returns when every group exited; raises when one failed or time ran out.
    """
    from phalanx.strategies.fault_tolerant import start_lighthouse  # the test process imports torchft only here

    print(f"chaos seed {seed} (set PHALANX_CHAOS_SEED={seed} to replay this schedule)", flush=True)
    chaos, rng, begin = Chaos(seed), random.Random(seed), time.monotonic()
    plan = _StepPlan(rng, steps, max_kills) if kill_every_s is None else _TimePlan(rng, kill_every_s, max_kills, steps)
    arguments = [str(steps), *job_args]
    # min_replicas=3: while a group is down the others wait (bounded by their quorum_timeout) for its restart, so that
    # no share of the data is skipped and every sample is trained once. Below 3 the others train on without it.
    join = timedelta(milliseconds=100 if min_replicas == 3 else 1000)  # below 3: time for a restarted group to join
    with start_lighthouse(min_replicas=min_replicas, join_timeout=join) as lighthouse:
        lives = [_start(out, group, 0, lighthouse.address, arguments) for group in range(3)]
        chaos.starts += [{"group": life.group, "life": 0, "time": life.started} for life in lives]
        last: int | None = None
        try:
            while any(life.process.poll() is None for life in lives):
                if time.monotonic() - begin > deadline_s:
                    raise TimeoutError(f"the chaos run (seed {seed}) did not finish within {deadline_s} s")
                if all("ready" in life.milestones for life in lives):
                    (out / "go").touch()  # the first lives set up: they form their first quorum together
                group = plan.victim(lives, last)
                if group is not None and lives[group].process.poll() is None:
                    victim, done = lives[group], max(life.committed for life in lives)
                    victim.process.send_signal(signal.SIGKILL)
                    victim.process.wait(timeout=30)
                    kill = {"group": group, "life": victim.life, "time": time.time(), "step": done}
                    chaos.kills.append({**kill, "milestones": sorted(victim.milestones)})
                    lives[group], last = _start(out, group, victim.life + 1, lighthouse.address, arguments), group
                    chaos.starts.append({"group": group, "life": victim.life + 1, "time": lives[group].started})
                time.sleep(0.01)
            chaos.codes = [life.process.wait(timeout=30) for life in lives]
        finally:
            for life in lives:
                if life.process.poll() is None:
                    life.process.kill()
                    life.process.wait(timeout=30)
    chaos.seconds = time.monotonic() - begin
    # Kills still planned when the groups finished came due in the last steps too (or never came due): left out.
    chaos.skipped = getattr(plan, "skipped", 0) + len(getattr(plan, "plan", ()))
    if chaos.codes != [0, 0, 0]:
        raise AssertionError(
            f"chaos run (seed {seed}): exit codes {chaos.codes}, kills {chaos.kills}; logs: {logs(out, 4000)}"
        )
    print(f"chaos seed {seed}: {len(chaos.kills)} kills in {chaos.seconds:.1f} s: {chaos.kills}", flush=True)
    return chaos


def journal(out: Path, group: int) -> list[dict[str, Any]]:
    """The records of all lives of ``group``, in order; a line torn by a kill is left out."""
    records = []
    for line in (out / f"group{group}.jsonl").read_text().splitlines():
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
