"""A save killed mid-write (SIGKILL) leaves hidden temporaries; the next successful save in that folder, or the next
run's ModelCheckpoint set-up, removes them, and only them (issue 33, item 4): a temporary of a process that still
runs (another run saving into the same folder) and one whose owner cannot be told (an earlier phalanx's name) stay.
Every layout: one file, sharded (DCP) directory, DeepSpeed directory (written through the IO's directory protocol,
as DeepSpeedStrategy does), each directly and through AsyncCheckpointIO."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from phalanx_distributed import SCRIPTS, clean_environment
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.temporaries import owner, owner_of

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Checkpoint directory"),
]

LAYOUTS = ["one_file", "sharded", "deepspeed", "async_one_file", "async_sharded", "async_deepspeed"]
sys.path.insert(0, str(SCRIPTS))
from killed_layout_save_job import save  # noqa: E402  (the same writes, here not killed)


def _killed_save(out: Path, layout: str) -> int:
    """Run the job until its write stalled, SIGKILL it, reap it; returns its pid."""
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "killed_layout_save_job.py"), str(out), layout],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_environment(),
    )
    received, deadline = b"", time.monotonic() + 180
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    try:
        while b"stalled" not in received and time.monotonic() < deadline and process.poll() is None:
            if selector.select(timeout=1):
                received += os.read(process.stdout.fileno(), 65536)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()
    assert b"stalled" in received and b"not stalled" not in received, received.decode(errors="replace")
    return process.pid


def _hidden(folder: Path) -> set[str]:
    return {name for name in os.listdir(folder) if name.startswith(".")}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Per layout: a folder holding what a save killed mid-write left, and the killed process's id."""
    folders = {}
    for layout in LAYOUTS:
        folder = tmp_path_factory.mktemp(layout)
        folders[layout] = (folder, _killed_save(folder, layout))
    return folders


def _next_save(folder: Path, layout: str) -> None:
    io = AsyncCheckpointIO() if layout.startswith("async_") else TorchCheckpointIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(io, layout.removeprefix("async_"), folder / "next.ckpt")
        io.teardown()  # waits for a background write


def _next_run(folder: Path, layout: str) -> None:
    callback = ModelCheckpoint(dirpath=folder, save_top_k=0)  # sets up in the folder, saves nothing
    quiet_trainer(max_steps=1, enable_checkpointing=True, callbacks=[callback]).fit(Regressor(), loaders()[0])


CLEANERS = {"the next successful save": _next_save, "the next run's ModelCheckpoint set-up": _next_run}


@pytest.mark.parametrize("cleaner", list(CLEANERS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_a_killed_save_left_is_removed_and_nothing_else(tmp_path, killed, layout, cleaner):
    source, pid = killed[layout]
    folder = tmp_path / "ckpts"
    shutil.copytree(source, folder, symlinks=True)
    left = {name for name in _hidden(folder) if (owner_of(name) or "").split("-")[1:2] == [str(pid)]}
    assert left and all(name.endswith(".tmp") for name in left), _hidden(folder)  # what the kill left, hidden
    assert not (folder / "killed.ckpt").exists()
    sizes = sum(f.stat().st_size for name in left for f in [folder / name, *(folder / name).rglob("*")] if f.is_file())
    assert sizes > 1 << 20  # the killed write's bytes (1 MiB of weights)

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        others = {
            f".other.ckpt.{owner(live.pid)}.{'a' * 32}.tmp",  # another run's write in flight: its process runs
            f".old.ckpt.{'b' * 32}.tmp",  # an earlier phalanx's temporary: its owner cannot be told
        }
        for name in others:
            (folder / name).write_bytes(b"in flight")
        CLEANERS[cleaner](folder, layout)
        assert _hidden(folder) & left == set(), _hidden(folder)  # the killed save's temporaries are gone
        assert others <= _hidden(folder)  # and nothing else
    finally:
        live.kill()
        live.wait()
    if cleaner == "the next successful save":
        assert (folder / "next.ckpt").exists()


def test_a_temporary_of_a_process_that_ended_is_stale_and_one_of_a_running_process_is_not(tmp_path):
    from phalanx.plugins.io.temporaries import is_stale, remove_stale_temporaries

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        names = {
            "ended": f".a.ckpt.{owner().split('-')[0]}-{int(ended.stdout)}-7.{'a' * 32}.tmp",
            "running": f".b.ckpt.{owner(live.pid)}.{'b' * 32}.tmp",
            "this process": f".c.ckpt.{owner()}.{'c' * 32}.tmp",
            # the id of a running process, but recorded with another start: the process that wrote it has ended
            "reused id": f".d.ckpt.{owner(live.pid).rsplit('-', 1)[0]}-1.{'d' * 32}.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"x")
        stale = {key for key, name in names.items() if is_stale(name)}
        assert stale == ({"ended", "reused id"} if owner().rsplit("-", 1)[1] != "0" else {"ended"})
        assert sorted(remove_stale_temporaries(tmp_path)) == sorted(names[key] for key in stale)
    finally:
        live.kill()
        live.wait()
