"""A real swarm on localhost: peers are subprocesses (phalanx_hivemind_peer.py) training the same small model.

One scenario runs once for the module (starting a peer costs seconds on this machine), and each test checks one
promise on what the peers recorded, as a volunteer swarm grows and shrinks:

    A starts the swarm alone  ->  B joins (2 peers)  ->  C joins (3 peers)  ->  B is killed  ->  A and C go on
    ->  A saves a checkpoint  ->  D resumes from it alone.

Every wait is bounded: a peer that does not reach a point in time ends the scenario with a message saying which and
showing its log; every peer is killed with its whole process group (hivemind's p2pd daemon and averagers) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "hivemind", reason="phalanx-hivemind's tests need hivemind (pip install ./integrations/phalanx-hivemind)"
)
torch = pytest.importorskip("torch")

PEER_SCRIPT = Path(__file__).with_name("phalanx_hivemind_peer.py")
SOLO_STEPS = 2  # B starts once A has taken this many swarm steps alone
TOGETHER = 2  # C starts once A and B have taken this many steps in step; B is killed after as many with C
AFTER_KILL = 2  # steps A and C take after B is killed
# A joiner holds the swarm's state before its first step (HivemindStrategy reads the swarm's progress afresh and
# downloads it before the first batch: test_hivemind_late_join.py). Its first swarm step may still be a round of its
# own, which hivemind logs: the swarm has not read its progress yet, nor has it read itself among the peers. The
# scenario waits this many more of its steps.
CATCH_UP = 1
PEER_SECONDS = 240  # each peer stops by itself after this long, whatever happened
WAIT_SECONDS = 120  # the longest the test waits for any one event (a missed averaging round costs 10 s)
PARAM_ATOL = 1e-5  # hivemind adds the averaged deltas in float32: peers agree to rounding, not always bitwise
# hivemind waits this long for a group twice a swarm step (the gradients, then the parameters): with the peer's 3 s a
# step of two or three peers took 6 s, nearly all of it waiting. 1.5 s leaves its requests (0.9 s) room under load.
MATCHMAKING_SECONDS = 1.5


class Swarm:
    """Starts peers, reads what they recorded, and kills them (each with its process group)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: dict[str, subprocess.Popen] = {}
        self.joined: dict[str, int] = {}  # the swarm step each late peer started at
        self.times: dict[str, float] = {}  # when the scenario's events happened (time.time(), as the records)
        self.killed_at = -1

    def start(self, name: str, *args: str) -> None:
        log = (self.workdir / f"{name}.log").open("w")
        command = [sys.executable, str(PEER_SCRIPT), "--name", name, "--out", str(self.workdir)]
        command += ["--max-seconds", str(PEER_SECONDS), "--matchmaking-time", str(MATCHMAKING_SECONDS), *args]
        # A session of its own: killing the group also ends the peer's p2pd daemon and averager processes.
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def records(self, name: str) -> list[dict[str, Any]]:
        path = self.workdir / f"{name}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is skipped

    def steps(self, name: str) -> dict[int, dict[str, Any]]:
        """The peer's records by swarm step (the first record of each step)."""
        result: dict[int, dict[str, Any]] = {}
        for record in self.records(name):
            if "params" in record:
                result.setdefault(record["epoch"], record)
        return result

    def wait_for(self, what: str, condition: Any, names: list[str]) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not condition():
            for name in names:
                process = self.processes[name]
                if process.poll() is not None and not condition():
                    pytest.fail(f"peer {name} exited ({process.returncode}) before {what}:\n{self.tail(name)}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {WAIT_SECONDS}s waiting for {what}; logs:\n" + self.tails(names))
            time.sleep(0.2)

    def address(self, name: str) -> str:
        self.wait_for(f"peer {name}'s DHT address", lambda: bool(self.records(name)), [name])
        return ",".join(self.records(name)[0]["addresses"])

    def last_step(self, name: str) -> int:
        return max(self.steps(name), default=-1)

    def wait_steps(self, names: list[str], step: int, why: str) -> None:
        reached = lambda: all(self.last_step(name) >= step for name in names)  # noqa: E731
        self.wait_for(f"{' and '.join(names)} to reach swarm step {step} ({why})", reached, names)

    def wait_in_step(self, names: list[str], count: int, since: float, why: str) -> None:
        """Wait until each peer recorded ``count`` distinct parameter vectors since ``since``: what the tests count
        (under load a joiner can skip swarm steps, so reaching a step number alone is not enough)."""
        enough = lambda: all(len(_trajectory(self, name, since, float("inf"))) >= count for name in names)  # noqa: E731
        self.wait_for(f"{' and '.join(names)} to record {count} steps ({why})", enough, ["a", *names])

    def ready(self, name: str) -> None:
        ready = lambda: any(record.get("ready") for record in self.records(name))  # noqa: E731
        self.wait_for(f"peer {name} to be ready to train", ready, [name])

    def join(self, name: str) -> int:
        """Let a peer started with ``--go-file <name>.go`` train; return the swarm step it joined at."""
        self.ready(name)
        (self.workdir / f"{name}.go").touch()
        self.wait_for(f"{name}'s first swarm step", lambda: bool(self.steps(name)), ["a", name])
        self.joined[name] = min(self.steps(name))
        return self.joined[name]

    def finish(self, name: str) -> None:
        try:
            self.processes[name].wait(timeout=WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"peer {name} did not finish within {WAIT_SECONDS}s:\n{self.tail(name)}")

    def kill(self, name: str) -> None:
        process = self.processes[name]
        if process.poll() is None or _group_alive(process.pid):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait(timeout=30)

    def tail(self, name: str) -> str:
        text = (self.workdir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-25:])

    def tails(self, names: list[str]) -> str:
        return "\n".join(f"--- {name}\n{self.tail(name)}" for name in names)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_scenario(swarm: Swarm) -> None:
    stop = ["--stop-file", str(swarm.workdir / "stop")]
    checkpoint = swarm.workdir / "a.ckpt"
    swarm.start("a", *stop, "--data-seed", "1", "--save", str(checkpoint))
    peers = ["--initial-peers", swarm.address("a")]
    for name, seed in (("b", "2"), ("c", "3")):  # built now, trained later: starting a peer takes a while
        swarm.start(name, *stop, *peers, "--data-seed", seed, "--go-file", str(swarm.workdir / f"{name}.go"))
    swarm.start("d", "--resume", str(checkpoint), "--run-id", "resumed", "--more-steps", "2")
    swarm.wait_steps(["a"], SOLO_STEPS, "alone")
    joined = swarm.join("b")
    swarm.wait_steps(["a", "b"], joined + CATCH_UP + TOGETHER, "two peers")
    swarm.wait_in_step(["b"], CATCH_UP + TOGETHER + 1, 0.0, "two peers")
    swarm.times["c joined"] = time.time()
    joined = swarm.join("c")
    swarm.wait_steps(["a", "c"], joined + CATCH_UP, "C catching up")
    swarm.times["c in step"] = time.time()
    swarm.wait_steps(["a", "b", "c"], joined + CATCH_UP + TOGETHER, "three peers")
    swarm.wait_in_step(["b", "c"], TOGETHER + 1, swarm.times["c in step"], "three peers")
    swarm.killed_at = max(swarm.last_step(name) for name in ("a", "b", "c"))
    swarm.kill("b")
    swarm.times["b killed"] = time.time()
    swarm.wait_steps(["a", "c"], swarm.killed_at + AFTER_KILL, "after B was killed")
    (swarm.workdir / "stop").touch()
    for name in ("a", "c", "d"):
        swarm.finish(name)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    # One run, no retry: a joiner used to step on its own parameters when the swarm's progress it had read was older
    # than its set-up (then A and B could miss every round, or B step alone for rounds); it now catches up first.
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        _run_scenario(swarm)
    finally:
        for name in list(swarm.processes):
            swarm.kill(name)
    yield swarm


def _trajectory(swarm: Swarm, name: str, since: float, until: float) -> list[Any]:
    """The peer's parameters after each swarm step it recorded between two times (a step that left them unchanged,
    such as catching up with the swarm's step count, adds nothing)."""
    vectors: list[Any] = []
    for _, record in sorted(swarm.steps(name).items()):
        vector = torch.tensor(record["params"])
        if since <= record["time"] <= until and not (vectors and torch.equal(vectors[-1], vector)):
            vectors.append(vector)
    return vectors


# hivemind's status lines (the peers run with verbose=True) for a round in which a peer did not average with the others
# and stepped on its own gradients: only after such a round may its parameters differ from A's.
SOLO_ROUND_LINES = ("Proceeding with local gradients", "Averaging gradients failed", "Peer is out of sync")


def _solo_rounds(swarm: Swarm, name: str) -> int:
    text = (swarm.workdir / f"{name}.log").read_text(errors="replace")
    return sum(text.count(line) for line in SOLO_ROUND_LINES)


def _assert_in_step(swarm: Swarm, name: str, since: float = 0.0, until: float = float("inf"), grace: int = 0) -> int:
    """``name`` holds A's parameters after each swarm step, in A's order; returns how many of its steps matched one of
    A's.

    Steps are matched by their parameters, not their numbers: hivemind lets a peer that has just caught up count one
    step behind the others (it stays in sync as long as it is at most one behind) while it averages with them, and a
    peer may miss one of A's steps. A step of ``name`` that matches none of A's is allowed only for a round that
    hivemind logged as not averaged together (SOLO_ROUND_LINES in A's or ``name``'s log): peers that averaged agree.
    Steps before its first match (its first steps after joining) must be rounds ``name`` itself logged as such, or one
    of ``grace`` steps.
    """
    reference, other = _trajectory(swarm, "a", 0.0, float("inf")), _trajectory(swarm, name, since, until)
    close = lambda x, y: (x - y).abs().max().item() <= PARAM_ATOL  # noqa: E731
    solo, own_solo = _solo_rounds(swarm, "a") + _solo_rounds(swarm, name), _solo_rounds(swarm, name)
    first = next((i for i, vector in enumerate(other) if any(close(p, vector) for p in reference)), None)
    if first is None or first > own_solo + grace:
        pytest.fail(
            f"{name}'s first {len(other) if first is None else first} recorded step(s) held none of A's parameters,"
            f" but it logged only {own_solo} round(s) averaged alone\n{swarm.tails(['a', name])}"
        )
    position, matched, strays = 0, 0, [f"step {offset} after joining" for offset in range(first)]
    for offset, vector in enumerate(other[first:], start=first):
        found = next((k for k in range(position, len(reference)) if close(reference[k], vector)), None)
        if found is None:
            nearest = min((reference[k] - vector).abs().max().item() for k in range(len(reference)))
            strays.append(f"step {offset} after joining (nearest of A's: {nearest:.3g})")
        else:
            matched, position = matched + 1, found + 1
    assert len(strays) <= solo + grace, f"{name} left A's parameters without a logged solo round ({solo}): {strays}"
    return matched


def test_two_peers_step_together_with_identical_parameters(swarm: Swarm) -> None:
    shared = _assert_in_step(swarm, "b", until=swarm.times["c joined"])
    assert shared >= TOGETHER, f"A and B shared only {shared} steps before C joined"


@pytest.mark.parametrize("name", ["b", "c"])
def test_three_peers_step_together_with_identical_parameters(swarm: Swarm, name: str) -> None:
    window = dict(since=swarm.times["c in step"], until=swarm.times["b killed"])
    assert _assert_in_step(swarm, name, **window) >= TOGETHER


@pytest.mark.parametrize("name", ["b", "c"])
def test_late_joiner_downloads_the_state_and_continues_in_step(swarm: Swarm, name: str) -> None:
    joined = swarm.joined[name]
    assert joined >= SOLO_STEPS, f"{name} started at swarm step {joined}: it did not download the swarm's state"
    assert "Downloading parameters from peer" in (swarm.workdir / f"{name}.log").read_text()
    # It holds A's parameters (never its own initial weights) from its first recorded step, but for rounds it logged as
    # averaged alone, and stays in step.
    until = swarm.times["b killed"] if name == "b" else float("inf")
    assert _assert_in_step(swarm, name, until=until) >= 2 * TOGETHER


def test_killing_a_peer_leaves_the_others_training(swarm: Swarm) -> None:
    assert swarm.processes["b"].returncode == -signal.SIGKILL
    assert all(record["time"] <= swarm.times["b killed"] for record in swarm.steps("b").values())
    for name in ("a", "c"):
        assert swarm.processes[name].returncode == 0, swarm.tail(name)
        assert swarm.last_step(name) >= swarm.killed_at + AFTER_KILL
        assert swarm.records(name)[-1].get("done"), f"{name} did not finish its fit"
    # A and C go on averaging with each other once B is gone (a round B was part of may fail: skip one step).
    since = min(r["time"] for s, r in swarm.steps("c").items() if s >= swarm.killed_at + 1)
    assert _assert_in_step(swarm, "c", since=since, grace=1) >= 1


def test_the_loss_goes_down(swarm: Swarm) -> None:
    losses = [record["loss"] for _, record in sorted(swarm.steps("a").items())]
    first, last = sum(losses[1:4]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, f"A's loss went from {first:.4f} to {last:.4f}"


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_learning_rate_follows_the_swarm_step(swarm: Swarm, name: str) -> None:
    # StepLR(gamma=0.99) configured with interval='step': hivemind steps it once per swarm step, on every peer, and a
    # peer that downloads (or resumes) a later state catches up.
    for step, record in swarm.steps(name).items():
        assert record["lr"] == pytest.approx(0.1 * 0.99**step), (name, step)


def test_checkpoint_saves_the_swarm_step_and_resumes_alone(swarm: Swarm) -> None:
    checkpoint = torch.load(swarm.workdir / "a.ckpt", weights_only=True)
    saved = swarm.records("a")[-1]["epoch"]
    assert checkpoint["hivemind"] == {"epoch": saved, "run_id": "phalanx_test"}
    assert set(checkpoint["optimizer_states"][0]["state"]) == {0, 1, 2, 3}  # the torch optimizer's own format
    resumed = swarm.steps("d")
    assert min(resumed) == saved, "D did not resume at the saved swarm step"
    weights = torch.cat([value.reshape(-1) for value in checkpoint["state_dict"].values()])
    assert torch.equal(torch.tensor(resumed[saved]["params"]), weights)
    assert max(resumed) == saved + 2
