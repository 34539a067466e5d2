"""A save never replaces what is not a checkpoint (issue 33, item 1): a named pipe, a socket, a character device
(/dev/null itself, which these tests may reach as root), a link to any of them or to a file outside, a folder of the
user's. Every way of saving refuses with ``CheckpointWriteError`` before anything is written, and leaves what is
there as it was; a regular file, a marked checkpoint directory and a link phalanx made are still replaced.

The /dev/null rows run with a trip wire: a rename, link or removal that touches /dev/null fails the test before it
happens, so that a regression cannot damage the machine's /dev/null."""

from __future__ import annotations

import os
import socket
import stat
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch import nn

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.callbacks._checkpoint_files import publish_link
from phalanx.cli import main
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.dcp import save_sharded
from phalanx.utilities.exceptions import CheckpointWriteError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Checkpoint directory")

DEV_NULL = Path("/dev/null")
NAME = "last.ckpt"


def _checkpoint() -> dict[str, Any]:
    return {"global_step": 1, "state_dict": {"w": torch.ones(3)}}


# ---------------------------------------------------------------------------- what is at the target
def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / NAME)
    return folder / NAME


def _socket(folder: Path) -> Path:
    held = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(folder)  # a relative name: a socket's path is limited to ~100 bytes
    try:
        held.bind(NAME)
    finally:
        os.chdir(cwd)
    _SOCKETS.append(held)
    return folder / NAME


_SOCKETS: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets() -> Any:
    yield
    while _SOCKETS:
        _SOCKETS.pop().close()


def _character_device(folder: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a character device needs root (the /dev/null row covers one)")
    os.mknod(folder / NAME, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # another /dev/null
    return folder / NAME


def _link_to(make_target: Callable[[Path], Path]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        outside = folder.parent / "outside"
        outside.mkdir(exist_ok=True)
        (folder / NAME).symlink_to(make_target(outside))
        return folder / NAME

    return make


def _outside_file(outside: Path) -> Path:
    (outside / "notes.txt").write_text("the user's notes")
    return outside / "notes.txt"


def _outside_fifo(outside: Path) -> Path:
    os.mkfifo(outside / "pipe")
    return outside / "pipe"


def _plain_folder(folder: Path) -> Path:
    (folder / NAME).mkdir()
    (folder / NAME / "notes.txt").write_text("the user's notes")
    return folder / NAME


TARGETS: dict[str, Callable[[Path], Path]] = {
    "a named pipe (FIFO)": _fifo,
    "a unix socket": _socket,
    "a character device": _character_device,
    "a link to /dev/null": _link_to(lambda outside: DEV_NULL),
    "a link to a FIFO": _link_to(_outside_fifo),
    "a link to a file outside": _link_to(_outside_file),
    "a folder that is no checkpoint": _plain_folder,
    "/dev/null itself": lambda folder: DEV_NULL,
}


def _state(path: Path) -> tuple[Any, ...]:
    """What is at ``path``, to compare before and after: its kind, a link's text, a folder's listing, a file's bytes."""
    info = os.lstat(path)
    kind = stat.S_IFMT(info.st_mode)
    link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
    listing = sorted(os.listdir(path)) if stat.S_ISDIR(info.st_mode) else None
    data = Path(os.path.realpath(path)).read_bytes() if link and os.path.isfile(path) else None
    return kind, info.st_ino, link, listing, data


# ---------------------------------------------------------------------------- every way of saving
@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Trainer after a fit, a set-up Cohort and a sharded checkpoint directory, shared by the rows."""
    root = tmp_path_factory.mktemp("fitted")
    trainer = quiet_trainer(max_steps=1, default_root_dir=root)
    trainer.fit(Regressor(), loaders()[0])
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)
    model = cohort.setup(nn.Linear(3, 1))
    sharded = root / "sharded.ckpt"
    save_sharded(_checkpoint(), sharded, is_global_zero=True, broadcast=lambda v: v, barrier=lambda n: None)
    source = root / "source.ckpt"
    torch.save(_checkpoint(), source)
    return {"trainer": trainer, "cohort": cohort, "model": model, "sharded": sharded, "source": source}


def _async_one_file(path: Path, fitted: dict[str, Any]) -> None:
    io = AsyncCheckpointIO()
    try:
        io.save_checkpoint(_checkpoint(), path)
        io.wait()
    finally:
        io._pending = []
        io.teardown()


def _async_directory(sharded: bool) -> Callable[[Path, dict[str, Any]], None]:
    def save(path: Path, fitted: dict[str, Any]) -> None:
        io = AsyncCheckpointIO()
        try:
            if sharded:
                io.save_sharded_checkpoint(_checkpoint(), path, collectives=Collectives())
            else:
                _deepspeed_layout(io, path)
            io.wait()
        finally:
            io._pending = []
            io.teardown()

    return save


def _deepspeed_layout(io: Any, path: Path) -> None:
    """A DeepSpeed checkpoint directory as DeepSpeedStrategy writes it, through the IO's directory protocol."""
    collectives = Collectives()
    staging = io.start_directory_checkpoint(path, collectives=collectives)
    io.makedirs(os.path.join(staging, "checkpoint"))
    io.save_checkpoint(_checkpoint(), os.path.join(staging, "checkpoint", "mp_rank_00_model_states.pt"))
    io.save_checkpoint(_checkpoint(), os.path.join(staging, "phalanx_deepspeed_state.pt"))
    io.finish_directory_checkpoint(staging, path, collectives=collectives)


def _fit_saving_last(save_last: Any) -> Callable[[Path, dict[str, Any]], None]:
    def save(path: Path, fitted: dict[str, Any]) -> None:
        callback = ModelCheckpoint(dirpath=path.parent, save_last=save_last, every_n_train_steps=1)
        trainer = quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[callback])
        trainer.fit(Regressor(), loaders()[0])

    return save


class ConsolidateRefused(Exception):
    """``phalanx checkpoint consolidate`` printed one error line and exited with status 2."""


def _consolidate(path: Path, fitted: dict[str, Any], capsys: Any) -> None:
    code = main(["checkpoint", "consolidate", "--overwrite", str(fitted["sharded"]), str(path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    if code == 2:
        raise ConsolidateRefused(err)


SAVERS: dict[str, Callable[..., None]] = {
    "TorchCheckpointIO": lambda path, f: TorchCheckpointIO().save_checkpoint(_checkpoint(), path),
    "Trainer.save_checkpoint": lambda path, f: f["trainer"].save_checkpoint(path),
    "Cohort.save": lambda path, f: f["cohort"].save(path, {"model": f["model"]}),
    "AsyncCheckpointIO, one file": _async_one_file,
    "sharded (DCP) directory": lambda path, f: TorchCheckpointIO().save_sharded_checkpoint(
        _checkpoint(), path, collectives=Collectives()
    ),
    "AsyncCheckpointIO, sharded directory": _async_directory(sharded=True),
    "DeepSpeed directory": lambda path, f: _deepspeed_layout(TorchCheckpointIO(), path),
    "AsyncCheckpointIO, DeepSpeed directory": _async_directory(sharded=False),
    "file:// URL, one file": lambda path, f: TorchCheckpointIO().save_checkpoint(_checkpoint(), f"file://{path}"),
    "file:// URL, sharded directory": lambda path, f: TorchCheckpointIO().save_sharded_checkpoint(
        _checkpoint(), f"file://{path}", collectives=Collectives()
    ),
    "copy (save_last=True's last.ckpt)": lambda path, f: TorchCheckpointIO().copy_checkpoint(f["source"], path),
    "link (save_last='link')": lambda path, f: publish_link(str(path.parent / "epoch=0.ckpt"), str(path)),
    "phalanx checkpoint consolidate --overwrite": _consolidate,
}


@pytest.fixture
def trip_wire(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Arms a wire that fails, before it happens, any rename, link or removal touching /dev/null or making an entry
    in /dev (armed once the test has made its target)."""

    def guarded(function: Callable[..., Any], first: int) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            for arg in args[first:2]:
                where = os.path.abspath(arg) if isinstance(arg, (str, os.PathLike)) else ""
                if where == str(DEV_NULL) or (function.__name__ == "mkdir" and os.path.dirname(where) == "/dev"):
                    raise AssertionError(
                        f"{function.__name__}{args[:2]} would touch /dev/null or make a folder in /dev"
                    )
            return function(*args, **kwargs)

        return run

    def arm() -> None:
        for name in ("replace", "rename", "unlink", "remove", "link", "mkdir", "rmdir"):
            monkeypatch.setattr(os, name, guarded(getattr(os, name), 0))
        monkeypatch.setattr(os, "symlink", guarded(os.symlink, 1))  # its first argument is the link's text

    return arm


@pytest.mark.parametrize("saver", list(SAVERS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_save_refuses_what_is_not_a_checkpoint_and_leaves_it(tmp_path, fitted, capsys, trip_wire, target, saver):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    path = TARGETS[target](folder)
    before = _state(path)
    dev_before = sorted(name for name in os.listdir("/dev") if name.startswith(".null"))
    trip_wire()
    arguments = (path, fitted, capsys) if saver.startswith("phalanx checkpoint") else (path, fitted)
    expected = ConsolidateRefused if saver.startswith("phalanx checkpoint") else CheckpointWriteError
    with warnings.catch_warnings(), pytest.raises(expected) as refused:
        warnings.simplefilter("ignore")
        SAVERS[saver](*arguments)
    message = str(refused.value)
    assert (str(path) in message) if expected is ConsolidateRefused else ("Refusing to write a checkpoint" in message)
    assert _state(path) == before  # the same entry, of the same kind, untouched
    assert stat.S_ISCHR(os.stat(DEV_NULL).st_mode)  # the machine's /dev/null is still a character device
    assert sorted(name for name in os.listdir("/dev") if name.startswith(".null")) == dev_before
    leftovers = [name for name in os.listdir(folder) if name.endswith(".tmp")]
    assert not leftovers, leftovers  # refused before anything was written


@pytest.mark.parametrize("save_last", [True, "link"])
@pytest.mark.parametrize("target", [name for name in TARGETS if name != "/dev/null itself"])
def test_model_checkpoint_leaves_what_is_at_its_last_name_and_takes_the_next(tmp_path, fitted, target, save_last):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    path = TARGETS[target](folder)
    before = _state(path)
    _fit_saving_last(save_last)(path, fitted)  # its claim finds the name taken: last-v1.ckpt instead
    assert _state(path) == before
    assert torch.load(folder / "last-v1.ckpt", weights_only=True)["global_step"] == 2


# ---------------------------------------------------------------------------- what a save still replaces
def _regular_file(folder: Path) -> Path:
    torch.save({"global_step": 0}, folder / NAME)
    return folder / NAME


def _marked_checkpoint(folder: Path) -> Path:
    save_sharded(_checkpoint(), folder / NAME, is_global_zero=True, broadcast=lambda v: v, barrier=lambda n: None)
    return folder / NAME


def _own_link(folder: Path) -> Path:
    torch.save(_checkpoint(), folder / "epoch=0.ckpt")
    (folder / NAME).symlink_to("epoch=0.ckpt")  # what save_last="link" makes: a relative link to a sibling
    return folder / NAME


REPLACEABLE = {"a regular file": _regular_file, "a marked checkpoint": _marked_checkpoint, "its own link": _own_link}


@pytest.mark.parametrize("saver", ["TorchCheckpointIO", "sharded (DCP) directory", "DeepSpeed directory"])
@pytest.mark.parametrize("target", list(REPLACEABLE))
def test_a_save_replaces_a_file_a_checkpoint_of_its_own_and_its_own_link(tmp_path, fitted, target, saver):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    path = REPLACEABLE[target](folder)
    SAVERS[saver](path, fitted)
    assert not path.is_symlink() and path.exists()
    if saver == "TorchCheckpointIO":
        assert torch.load(path, weights_only=True)["global_step"] == 1
    else:
        assert (path / ".complete").is_file()
