"""Runs one scenario of xla_scenarios.py in a fresh process on the PJRT CPU runtime, with a time limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).with_name("xla_scenarios.py")
ROOT = Path(__file__).resolve().parents[2]


def run_scenario(
    name: str, workdir: Path, devices: int, timeout: float = 420, script: Path = SCENARIOS, **env: str
) -> dict[str, Any]:
    """The scenario's result; a failure, a crash or running past ``timeout`` seconds fails with its output."""
    # PYTHONFAULTHANDLER: a crash of the scenario (or of the process torch_xla's launcher starts) prints every thread.
    variables = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "PYTHONFAULTHANDLER": "1", **env}
    variables["PYTHONPATH"] = os.pathsep.join([str(ROOT), variables.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # A session of its own: on a hang the scenario and the process torch_xla's launcher started end together.
    with subprocess.Popen(
        [sys.executable, str(script), name],
        cwd=workdir,
        env=variables,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            message = f"scenario {name!r} ran past {timeout} s (a hang); its output:\n{stderr[-4000:]}"
            raise AssertionError(message) from None
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert process.returncode == 0 and lines, f"scenario {name!r} failed ({process.returncode}):\n{stderr[-12000:]}"
    return json.loads(lines[-1][len("RESULT ") :])
