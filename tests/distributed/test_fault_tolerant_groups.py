"""strategy='ddp_ft' with replica groups of two processes each (two groups and a lighthouse in this process): one
process of group 1 is killed with SIGKILL, the whole group ends, group 0 trains on alone, and the restarted group heals
from group 0's live state; every process ends with the weights of one process trained on the committed batches."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
from phalanx_distributed import SCRIPTS, clean_environment, free_port

pytest.importorskip("torchft")

GROUPS = 2
WAIT_S = 240  # bound on every wait of the fixture: a hang fails the test instead of blocking CI


class Group:
    """One life of a replica group (its launcher process; the launcher starts the second process), its output read."""

    def __init__(self, out: Path, strategy: str, group: int, life: int, lighthouse: str) -> None:
        environment = clean_environment(
            REPLICA_GROUP_ID=str(group),
            NUM_REPLICA_GROUPS=str(GROUPS),
            TORCHFT_LIGHTHOUSE=lighthouse,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),  # each group has its own store
        )
        command = [sys.executable, str(SCRIPTS / "ft_multi_process_job.py"), str(out), strategy]
        self.process = subprocess.Popen(
            command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.log = out / f"group{group}.life{life}.log"
        self.lines: list[str] = []
        self.changed = threading.Condition()
        assert self.process.stdout is not None
        threading.Thread(target=self._copy, args=(self.process.stdout,), daemon=True).start()

    def _copy(self, stream: IO[str]) -> None:
        with self.log.open("w") as file:
            for line in stream:
                file.write(line)
                file.flush()
                with self.changed:
                    self.lines.append(line.rstrip("\n"))
                    self.changed.notify_all()

    def wait_for(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` lines matching ``pattern``, waiting for them (bounded)."""
        deadline = time.monotonic() + WAIT_S
        with self.changed:
            while True:
                found = [m for m in (re.search(pattern, line) for line in self.lines) if m]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise AssertionError(f"no {count} line(s) matching {pattern!r}: {self.log.read_text()[-4000:]}")
                self.changed.wait(timeout=min(left, 1.0))


def _wait_for_waiting_joiner(lighthouse: str) -> None:
    """Until the lighthouse holds one group's quorum request while two groups send heartbeats (the other one holds)."""
    deadline = time.monotonic() + WAIT_S
    while "[1/1 participants healthy][2 heartbeating]" not in (status := _status(lighthouse)):
        assert time.monotonic() < deadline, f"the restarted group never asked for a quorum: {status}"
        time.sleep(0.1)


def _status(lighthouse: str) -> str:
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as response:
        return response.read().decode()


def _launch(out: Path, strategy: str, lighthouse: str) -> dict[str, object]:
    """Start both groups; kill a process of group 1 after its first committed step; restart it once group 0 trained
    alone; return the exit codes and logs."""
    (out / "hold1").touch()  # group 1 waits after its first committed step: it is killed there
    groups = [Group(out, strategy, group, 0, lighthouse) for group in range(GROUPS)]
    try:
        for group in groups:
            group.wait_for(r"pid \d+ ready", count=2)
        (out / "start").touch()
        (victim,) = groups[1].wait_for(r"group 1 rank 1 pid (\d+) holding")
        subprocess.run(["kill", "-KILL", victim.group(1)], check=True)
        killed_code = groups[1].process.wait(timeout=WAIT_S)
        (out / "hold1").unlink()
        (out / "hold0").touch()  # group 0 waits once it committed a step alone: the restarted group then joins
        groups[0].wait_for(r"group 0 rank \d pid \d+ holding", count=2)
        restarted = Group(out, strategy, 1, 1, lighthouse)
        _wait_for_waiting_joiner(lighthouse)
        (out / "go0").touch()
        codes = [groups[0].process.wait(timeout=WAIT_S), restarted.process.wait(timeout=WAIT_S)]
    finally:
        for group in groups + [locals().get("restarted")]:
            if isinstance(group, Group) and group.process.poll() is None:
                group.process.kill()
                group.process.wait(timeout=30)
    return {"killed_code": killed_code, "codes": codes, "logs": [g.log.read_text() for g in groups + [restarted]]}


@pytest.fixture(scope="module")
def ddp_ft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from phalanx.strategies.fault_tolerant import start_lighthouse

    out = tmp_path_factory.mktemp("ddp_ft_groups")
    # One group is enough for a quorum; a group that sends heartbeats but has not asked yet is waited for (up to
    # join_timeout), as is a half of the heartbeating groups (torchft's lighthouse refuses a split brain).
    with start_lighthouse(min_replicas=1, join_timeout=timedelta(seconds=30)) as lighthouse:
        run = _launch(out, "ddp_ft", lighthouse.address)
    assert run["codes"] == [0, 0], f"exit codes {run['codes']}; logs: {[log[-4000:] for log in run['logs']]}"
    sys.path.insert(0, str(SCRIPTS))
    try:
        import ft_multi_process_job as job
    finally:
        sys.path.remove(str(SCRIPTS))
    run["reference"] = job.reference_fit(out)
    run["steps"] = job.committed_steps(out)
    run["results"] = {path.name: json.loads(path.read_text()) for path in sorted(out.glob("group*.rank*.json"))}
    run["max_steps"], run["batch"] = job.STEPS, job.BATCH
    return run


def test_every_process_ends_with_the_weights_of_one_process_on_the_committed_batches(ddp_ft):
    assert len(ddp_ft["results"]) == 4, sorted(ddp_ft["results"])
    for name, result in ddp_ft["results"].items():
        assert result["global_step"] == ddp_ft["max_steps"]
        for got, want in zip(result["weights"], ddp_ft["reference"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, f"{name} differs from the reference"


def test_the_survivor_committed_steps_alone_and_with_the_restarted_group(ddp_ft):
    sizes = [len(indices) for indices in ddp_ft["steps"]]
    both, alone = 2 * 2 * ddp_ft["batch"], 2 * ddp_ft["batch"]
    assert len(sizes) == ddp_ft["max_steps"] and sizes[0] == both and alone in sizes and sizes[-1] == both, sizes
    indices = [index for step in ddp_ft["steps"] for index in step]
    assert len(set(indices)) == len(indices)  # no sample trained twice by committed steps


def test_killing_one_process_ends_its_whole_group(ddp_ft):
    first_life = ddp_ft["logs"][1]
    assert ddp_ft["killed_code"] == 1, first_life[-3000:]
    assert f"a process of this job exited with status {-signal.SIGKILL}; stopping the others" in first_life


def test_the_logs_say_when_a_group_left_and_rejoined(ddp_ft):
    survivor, _, restarted = ddp_ft["logs"]
    assert "Replica group 0 joined quorum" in survivor and "of replica groups [0, 1]." in survivor
    left = survivor.index("Replica group(s) [1] left the quorum")
    assert "replica group 0 trains on with replica groups [0]." in survivor[left:]
    assert "Replica group(s) [1] joined the quorum" in survivor[left:]
    healed = re.search(r"Replica group 1 healed from a peer \(no checkpoint read\).*global_step=(\d+)", restarted)
    assert healed and int(healed.group(1)) >= 2, restarted[-3000:]
