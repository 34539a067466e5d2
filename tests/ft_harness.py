"""The fault-tolerance tests' harness: replica groups started as processes, their output read, what they left read.

Shared by tests/distributed/test_fault_tolerant_*.py, the scripts they start (tests/distributed/scripts/ft_*.py) and,
through ft_chaos.py, bench/bench_fault_tolerance.py. It imports neither torch nor phalanx at module level: job scripts
import it too, and the chaos bench times their imports.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, TextIO

from phalanx_distributed import SCRIPTS, clean_environment, free_port

#: Bound on every wait of a test's fixture: a hang fails the test instead of blocking CI.
WAIT_S = 240


def group_environment(group: int, groups: int, lighthouse: str, **extra: str) -> dict[str, str]:
    """The environment of one replica group: its id, the number of groups, the lighthouse, and a store of its own;
    ``extra`` last (it may override those)."""
    environment = clean_environment(
        REPLICA_GROUP_ID=str(group),
        NUM_REPLICA_GROUPS=str(groups),
        TORCHFT_LIGHTHOUSE=lighthouse,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),  # each group has its own store
    )
    environment.update(extra)
    return environment


class GroupLife:
    """One life of a replica group: its process, whose output goes line by line to ``OUT/group<g>.life<l>.log`` and
    is kept for :meth:`wait_for` (``on_line`` sees each line first). ``stdin=True`` opens a pipe to its input."""

    def __init__(
        self,
        out: Path,
        group: int,
        life: int,
        command: list[str],
        environment: dict[str, str],
        *,
        stdin: bool = False,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.group, self.life, self.started = group, life, time.time()
        self.log = out / f"group{group}.life{life}.log"
        self.process = subprocess.Popen(
            command,
            env=environment,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._on_line = on_line
        self._ended = False  # the output reached its end (the process exited and every line was read)
        self._changed = threading.Condition()
        assert self.process.stdout is not None
        threading.Thread(target=self._copy, args=(self.process.stdout,), daemon=True).start()

    def _copy(self, stream: TextIO) -> None:
        with self.log.open("w") as file:
            for line in stream:
                file.write(line)
                file.flush()
                if self._on_line is not None:
                    self._on_line(line)
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` lines matching ``pattern``, waiting for them (at most WAIT_S; an AssertionError with the
        log's end when the process ended without them)."""
        deadline = time.monotonic() + WAIT_S
        with self._changed:
            while True:
                found = [m for m in (re.search(pattern, line) for line in self.lines) if m]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    raise AssertionError(f"no {count} line(s) matching {pattern!r}: {self.log.read_text()[-4000:]}")
                self._changed.wait(timeout=min(left, 1.0))

    def send(self, line: str) -> None:
        """Write ``line`` to the process's input (started with ``stdin=True``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def wait(self, timeout: float = WAIT_S) -> int:
        """The process's exit status (waiting at most ``timeout`` seconds)."""
        return self.process.wait(timeout=timeout)


def script_life(
    out: Path, script: str, group: int, life: int, environment: dict[str, str], *args: str, **options: Any
) -> GroupLife:
    """A life of a replica group running ``tests/distributed/scripts/<script> OUT ARGS...``."""
    command = [sys.executable, str(SCRIPTS / script), str(out), *args]
    return GroupLife(out, group, life, command, environment, **options)


def stop(processes: Iterable[subprocess.Popen[Any] | GroupLife | None]) -> None:
    """Kill what is still running of ``processes`` (a fixture's ``finally``: no process outlives its test)."""
    for entry in processes:
        process = entry.process if isinstance(entry, GroupLife) else entry
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def logs(out: Path, tail: int = 6000) -> dict[str, str]:
    """The end of every log under ``out`` by name (for a failure's message)."""
    return {log.name: log.read_text()[-tail:] for log in sorted(out.glob("*.log"))}


def check_exit_codes(out: Path, codes: list[int], expected: list[int]) -> None:
    """Fail with the logs' ends unless the processes exited with ``expected``."""
    assert codes == expected, f"exit codes {codes}; logs: {logs(out)}"


def import_script(name: str) -> ModuleType:
    """A script of tests/distributed/scripts/ as a module (its constants, models and references; not a package)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def group_results(out: Path, groups: int) -> list[Any]:
    """What each replica group's job wrote last: ``OUT/group<g>.json``."""
    return [read_json(out / f"group{group}.json") for group in range(groups)]


def json_lines(path: Path) -> list[Any]:
    """The records of a file a job appends one JSON line to at a time (every line whole: none torn by a kill)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def log_phalanx_to_stdout() -> None:
    """In a job script: phalanx's INFO lines (a group left, joined or healed from a peer) on stdout, for the test."""
    logger = logging.getLogger("phalanx")
    logger.addHandler(logging.StreamHandler(sys.stdout))
    logger.setLevel(logging.INFO)


# ------------------------------------------------------------------ scripts/ft_multi_process_job.py: 2 groups of 2
def _lighthouse_status(lighthouse: str) -> str:
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as response:
        return response.read().decode()


def _wait_for_waiting_joiner(lighthouse: str) -> None:
    """Until the lighthouse holds one group's quorum request while two groups send heartbeats (the other one holds)."""
    deadline = time.monotonic() + WAIT_S
    while "[1/1 participants healthy][2 heartbeating]" not in (status := _lighthouse_status(lighthouse)):
        assert time.monotonic() < deadline, f"the restarted group never asked for a quorum: {status}"
        time.sleep(0.1)


def _steered_lives(out: Path, strategy: str, lighthouse: str) -> dict[str, Any]:
    """Start both groups; kill a process of group 1 after its first committed step; restart it once group 0 trained
    alone; return the exit codes and logs."""

    def start(group: int, life: int) -> GroupLife:
        environment = group_environment(group, 2, lighthouse)
        return script_life(out, "ft_multi_process_job.py", group, life, environment, strategy)

    (out / "hold1").touch()  # group 1 waits after its first committed step: it is killed there
    lives = [start(group, 0) for group in range(2)]
    try:
        for life in lives:
            life.wait_for(r"pid \d+ ready", count=2)
        (out / "start").touch()
        (victim,) = lives[1].wait_for(r"group 1 rank 1 pid (\d+) holding")
        subprocess.run(["kill", "-KILL", victim.group(1)], check=True)
        killed_code = lives[1].wait()
        (out / "hold1").unlink()
        (out / "hold0").touch()  # group 0 waits once it committed a step alone: the restarted group then joins
        lives[0].wait_for(r"group 0 rank \d pid \d+ holding", count=2)
        lives.append(start(1, 1))
        _wait_for_waiting_joiner(lighthouse)
        (out / "go0").touch()
        codes = [lives[0].wait(), lives[2].wait()]
    finally:
        stop(lives)
    return {"killed_code": killed_code, "codes": codes, "logs": [life.log.read_text() for life in lives]}


def steered_kill_and_rejoin(out: Path, strategy: str) -> dict[str, Any]:
    """Two replica groups of two processes (scripts/ft_multi_process_job.py on ``strategy``): a process of group 1 is
    killed after its first committed step, the whole group ends, group 0 trains on alone, and group 1 is restarted.
    The exit codes, the three lives' logs (group 0, group 1's first life, its restart), the job module, each committed
    step's samples and each process's results."""
    from phalanx.strategies.fault_tolerant import start_lighthouse  # lazy: the test process imports torchft only here

    # One group is enough for a quorum; a group that sends heartbeats but has not asked yet is waited for (up to
    # join_timeout), as is a half of the heartbeating groups (torchft's lighthouse refuses a split brain).
    with start_lighthouse(min_replicas=1, join_timeout=timedelta(seconds=30)) as lighthouse:
        run = _steered_lives(out, strategy, lighthouse.address)
    assert run["codes"] == [0, 0], f"exit codes {run['codes']}; logs: {[log[-4000:] for log in run['logs']]}"
    job = import_script("ft_multi_process_job")
    run["job"], run["max_steps"], run["batch"] = job, job.STEPS, job.BATCH
    run["steps"] = job.committed_steps(out)
    run["results"] = {path.name: read_json(path) for path in sorted(out.glob("group*.rank*.json"))}
    return run
