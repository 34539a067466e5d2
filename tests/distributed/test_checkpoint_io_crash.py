"""kill -9 during a background (AsyncCheckpointIO) write leaves the previous checkpoint of that name loadable, for
the one-file and the sharded layout (scripts/async_crash_job.py, one process)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.plugins.io import TorchCheckpointIO
from phalanx.plugins.io.layout import checkpoint_layout

SCRIPT = Path(__file__).parent / "scripts" / "async_crash_job.py"


def _run_until_stalled(out: Path) -> list[str]:
    """Start the job, wait until both second writes stalled and the saves returned, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()]))}
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    received = b""  # read from the file descriptor itself: a buffered reader would hide lines from select()
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 120
    lines: list[str] = []
    try:
        while time.monotonic() < deadline and process.poll() is None:
            lines = received.decode(errors="replace").splitlines()
            if "second-returned" in lines and sum(line.startswith("stalled") for line in lines) >= 2:
                break
            if selector.select(timeout=1):
                received += os.read(process.stdout.fileno(), 65536)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()
    return lines


def test_kill_during_a_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    lines = _run_until_stalled(tmp_path)
    assert "second-returned" in lines, lines  # the saves returned while their writes were pending
    assert sum(line.startswith("stalled") for line in lines) >= 2, lines
    for name, layout in (("file.ckpt", "file"), ("sharded.ckpt", "sharded")):
        assert checkpoint_layout(tmp_path / name) == layout
        loaded = TorchCheckpointIO().load_checkpoint(tmp_path / name)
        assert loaded["global_step"] == 1  # the first save, whole
        torch.testing.assert_close(loaded["state_dict"]["w"], torch.full((256, 256), 1.0))
    # What the killed saves left is hidden (a staging name), never taken for a checkpoint.
    assert all(p.name.startswith(".") for p in tmp_path.iterdir() if p.name not in ("file.ckpt", "sharded.ckpt"))


pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
