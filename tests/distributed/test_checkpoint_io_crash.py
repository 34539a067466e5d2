"""kill -9 during a save: a background (AsyncCheckpointIO) write leaves the previous checkpoint of that name loadable,
for the one-file and the sharded layout (scripts/async_crash_job.py); a fit killed at each point of a save leaves no
incomplete file under a final name, and ``last.ckpt`` names a complete checkpoint (scripts/killed_save_job.py)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.plugins.io import TorchCheckpointIO
from phalanx.plugins.io.formats.layout import checkpoint_layout

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


# ---------------------------------------------------------------------------- a fit's save killed at each point
KILLED_SAVE = Path(__file__).parent / "scripts" / "killed_save_job.py"


@pytest.fixture(scope="module")
def killed_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], tuple[Path, int, str]]:
    """(IO, SAVE_LAST, POINT) of each killed fit below -> its folder, its exit status and its output.

    The fits are independent single processes that mostly import torch: they run at once, on every core."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()]))}
    logs = tmp_path_factory.mktemp("killed_fit_logs")  # files, not pipes: no job waits on a full pipe meanwhile
    started: dict[tuple[str, str, str], tuple[Path, subprocess.Popen, Any]] = {}
    try:
        for key in KILLED_FITS:
            folder, log = tmp_path_factory.mktemp("_".join(key)), (logs / f"{'_'.join(key)}.log").open("w")
            command = [sys.executable, str(KILLED_SAVE), str(folder), *key]
            started[key] = (folder, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        results = {}
        for key, (folder, process, log) in started.items():
            process.wait(timeout=300)
            results[key] = (folder, process.returncode, Path(log.name).read_text())
        return results
    finally:
        for _, process, log in started.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            log.close()


def _fit_killed(killed_fits: dict, io: str, save_last: str, point: str) -> Path:
    """The folder of the fit whose save at step 4 was killed at ``point``, once its process is known killed."""
    folder, returncode, output = killed_fits[io, save_last, point]
    assert returncode == -signal.SIGKILL, (returncode, output[-3000:])
    return folder


def _visible(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir() if not p.name.startswith("."))


def _resumed_fit(dirpath: Path, ckpt_path: str, save_last: Any = None) -> int:
    """Fit to step 6 in ``dirpath``, resumed from ``ckpt_path``; returns the global step it resumed at."""
    from phalanx_testing import Regressor, loaders, quiet_trainer

    from phalanx.callbacks import Callback, ModelCheckpoint

    class ResumedAt(Callback):
        step = -1

        def on_train_start(self, trainer: Any, module: Any) -> None:
            ResumedAt.step = trainer.global_step

    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=save_last)
    trainer = quiet_trainer(max_steps=6, callbacks=[callback, ResumedAt()], enable_checkpointing=True)
    trainer.fit(Regressor(), loaders()[0], ckpt_path=ckpt_path)
    assert trainer.global_step == 6
    return ResumedAt.step


STEP = "epoch=0-step={}.ckpt"
# point of step 4's write where the process is killed -> what a listing shows after the kill, then after a new run
# (resumed from step 2, saving steps 4 and 6 again, in the same folder) has reclaimed what the killed save left.
KILL_POINTS = [
    ("claimed", [STEP.format(2)], [STEP.format(2), STEP.format(4), STEP.format(6)]),
    ("writing", [STEP.format(2)], [STEP.format(2), STEP.format(4), STEP.format(6)]),
    ("written", [STEP.format(2)], [STEP.format(2), STEP.format(4), STEP.format(6)]),
    # In place and whole: a checkpoint of the killed run, which the new run keeps (its own takes the next version).
    (
        "renamed",
        [STEP.format(2), STEP.format(4)],
        [STEP.format(2), STEP.format(4), "epoch=0-step=4-v1.ckpt", STEP.format(6)],
    ),
]


SAVE_LASTS = ["true", "link"]
KILLED_FITS = [("sync", "none", point) for point, _, _ in KILL_POINTS] + [("async", s, "written") for s in SAVE_LASTS]


@pytest.mark.parametrize(("point", "after_kill", "after_next_run"), KILL_POINTS, ids=[p[0] for p in KILL_POINTS])
def test_a_killed_save_leaves_no_incomplete_file_under_a_final_name(killed_fits, point, after_kill, after_next_run):
    folder = _fit_killed(killed_fits, "sync", "none", point)
    assert _visible(folder) == after_kill  # an incomplete save shows nothing under its final name
    for name in after_kill:
        step = int(name.split("step=")[1].split(".")[0])
        assert torch.load(folder / name, weights_only=True)["global_step"] == step  # every visible file is whole
    assert _resumed_fit(folder, str(folder / STEP.format(2))) == 2
    # The killed save's claim and temporaries were reclaimed: its name was free again (no -v1) unless written.
    assert sorted(p.name for p in folder.iterdir()) == sorted(after_next_run)


@pytest.mark.parametrize("save_last", SAVE_LASTS)
def test_a_save_killed_in_the_background_keeps_last_at_the_previous_complete_checkpoint(killed_fits, save_last):
    folder = _fit_killed(killed_fits, "async", save_last, "written")
    assert _visible(folder) == sorted([STEP.format(2), "last.ckpt"])
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    assert _resumed_fit(folder, "last", save_last=True if save_last == "true" else "link") == 2  # newest complete
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6


pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
