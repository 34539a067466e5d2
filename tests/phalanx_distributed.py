"""The one helper through which distributed tests start real processes (CPU, gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "distributed" / "scripts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without launcher or cluster variables (tests set the ones they mean)."""
    # PL_ too: a seed another test left in PL_GLOBAL_SEED would reseed Lightning's samplers in an oracle job.
    prefixes = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "TORCHELASTIC_", "PHALANX_", "PL_")
    names = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_WORLD_SIZE",
    }
    environment = {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), environment.get("PYTHONPATH", "")])
    environment["PYTHONUNBUFFERED"] = "1"
    environment.update(extra)
    return environment


@dataclass
class Job:
    """A finished job: exit status, output and how long it took."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run(
    command: list[str], *, env: dict[str, str] | None = None, timeout: float = 180, cwd: str | Path | None = None
) -> Job:
    """Run ``command`` to completion (killing its whole process group on timeout)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        env=env or clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"job timed out after {timeout} s: {command}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        ) from None
    return Job(proc.returncode, stdout, stderr, time.monotonic() - start)


def run_script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> Job:
    """Run ``tests/distributed/scripts/<name>`` with this interpreter; the script starts its own ranks."""
    return run([sys.executable, str(SCRIPTS / name), *args], env=env, timeout=timeout)


def processes_with_marker(marker: str) -> list[str]:
    """Command lines of live processes containing ``marker`` (to prove none is left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command:
            found.append(command)
    return found


def assert_ok(job: Job) -> None:
    assert job.returncode == 0, (
        f"job failed with {job.returncode}\n--- stdout\n{job.stdout[-4000:]}\n--- stderr\n{job.stderr[-6000:]}"
    )
