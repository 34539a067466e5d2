"""Directory checkpoints replace one another so that a complete one is visible at every instant of a save.

The kill tests fork a child that publishes a new checkpoint over an old one of the same name and dies (``os._exit``,
no clean-up runs, as with ``kill -9``) before or after its k-th file-system operation, for every k until a child
finishes. After each death ``ckpt_path="auto"``'s search must find a complete checkpoint holding the old or the new
step, and that checkpoint must load.
"""

from __future__ import annotations

import os

import pytest
import torch
from phalanx_testing import Regressor, loaders
from torch import nn

import phalanx
from phalanx.plugins.io import directory
from phalanx.plugins.io.formats.dcp import load_whole, save_sharded
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.trainer.checkpoint import COMPLETE_MARKER, is_complete_checkpoint, newest_complete_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill tests fork"),
]
_KILLED = 137
_OPERATIONS = ("write_synced", "sync_directory", "exchange_paths", "_remove")


def _checkpoint(step: int) -> dict:
    torch.manual_seed(step)
    model = nn.Linear(3, 2)
    return {"global_step": step, "state_dict": model.state_dict(), "loops": {"fit_loop": {"epoch": 0}}}


def _save(checkpoint: dict, path) -> None:
    save_sharded(checkpoint, path, is_global_zero=True, broadcast=lambda value: value, barrier=lambda name: None)


def _publish_and_die(staging, target, kill_at: int, *, exchange: bool) -> int:
    """Fork a child that publishes ``staging`` at ``target`` and dies around its ``kill_at``-th operation."""
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        count = [0]

        def tick() -> None:
            count[0] += 1
            if count[0] == kill_at:
                os._exit(_KILLED)

        def counted(function):
            def run(*args, **kwargs):
                tick()
                result = function(*args, **kwargs)
                tick()
                return result

            return run

        for name in _OPERATIONS:
            setattr(directory, name, counted(getattr(directory, name)))
        if not exchange:
            directory.exchange_paths = counted(lambda first, second: False)
        directory.os.replace = counted(os.replace)
        directory.publish_directory(staging, target)
        os._exit(0)
    except BaseException:  # noqa: BLE001 - the child must never return into pytest
        os._exit(1)


def _stage(root, step: int):
    """A finished but unpublished staging directory for ``last.ckpt``, written as a real save would."""
    target = root / "last.ckpt"
    staging = directory.staging_directory(target, is_global_zero=True, broadcast=lambda value: value)
    save_sharded(
        _checkpoint(step), staging / "inner.ckpt", is_global_zero=True, broadcast=lambda v: v, barrier=lambda n: None
    )
    for entry in (staging / "inner.ckpt").iterdir():
        entry.rename(staging / entry.name)
    (staging / "inner.ckpt").rmdir()
    (staging / COMPLETE_MARKER).unlink()  # publish_directory writes the marker itself
    return staging, target


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_a_kill_at_any_point_of_a_replacing_save_leaves_a_complete_checkpoint(tmp_path, exchange):
    if exchange and directory._renameat2() is None:
        pytest.skip("no renameat2 on this system")
    kill_at, finished = 1, False
    while not finished:
        root = tmp_path / f"kill{kill_at}"
        root.mkdir()
        _save(_checkpoint(1), root / "last.ckpt")
        staging, target = _stage(root, step=2)
        status = _publish_and_die(staging, target, kill_at, exchange=exchange)
        assert status in (0, _KILLED), f"the child failed at operation {kill_at} (status {status})"
        finished = status == 0
        found = newest_complete_checkpoint([root])
        assert found is not None, (
            f"no complete checkpoint visible after a kill at operation {kill_at}:"
            f" {sorted(p.name for p in root.iterdir())}"
        )
        step = load_whole(found)["global_step"]
        assert step in (1, 2)
        if (root / "last.ckpt" / COMPLETE_MARKER).exists() and load_whole(root / "last.ckpt")["global_step"] == 2:
            assert step == 2, "the new checkpoint is in place but resume would pick the old one"
        kill_at += 1
        assert kill_at < 60, "publishing never finished"
    assert sorted(p.name for p in root.iterdir()) == ["last.ckpt"]  # nothing retired or staged is left behind
    assert kill_at > 6  # the loop really killed the save at several points


def test_a_retired_copy_left_by_a_kill_is_resumed_and_removed_by_the_next_save(tmp_path):
    _save(_checkpoint(1), tmp_path / "last.ckpt")
    retired = tmp_path / f".last.ckpt.{'a' * 32}.retired"
    (tmp_path / "last.ckpt").rename(retired)  # the state between the two renames of the fallback
    assert is_complete_checkpoint(retired)
    assert newest_complete_checkpoint([tmp_path]) == str(retired.resolve())
    assert TorchCheckpointIO().load_checkpoint(retired)["global_step"] == 1
    _save(_checkpoint(2), tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert load_whole(tmp_path / "last.ckpt")["global_step"] == 2


@pytest.mark.parametrize(
    "name",
    [
        ".last.ckpt.retired",
        f".last.ckpt.{'a' * 31}.retired",
        f"last.ckpt.{'a' * 32}.retired",
        f".last.ckpt.{'g' * 32}.retired",
        f".last.ckpt.{'a' * 32}.tmp",
    ],
)
def test_only_well_formed_retired_copies_with_their_marker_count(tmp_path, name):
    path = tmp_path / name
    path.mkdir()
    (path / COMPLETE_MARKER).touch()
    assert newest_complete_checkpoint([tmp_path]) is None
    unmarked = tmp_path / f".x.ckpt.{'b' * 32}.retired"
    unmarked.mkdir()
    assert newest_complete_checkpoint([tmp_path]) is None  # retired but never completed


def test_exchange_swaps_two_directories_or_reports_it_cannot(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "one").touch()
    (second / "two").touch()
    if not directory.exchange_paths(first, second):
        pytest.skip("no atomic exchange on this system")
    assert (first / "two").exists() and (second / "one").exists()
    with pytest.raises(OSError, match="Could not swap"):
        directory.exchange_paths(first, tmp_path / "missing")


class _CountSteps(phalanx.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches += 1


def test_fit_resumes_from_the_retired_copy_a_kill_left(tmp_path):
    train, _ = loaders()
    options = dict(
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer = phalanx.Trainer(max_steps=4, **options)
    trainer.fit(Regressor(), train)
    folder = tmp_path / "checkpoints"  # where this run writes: its preemption folder (no ModelCheckpoint here)
    _save(trainer._checkpoint_connector.dump(), folder / "last.ckpt")
    (folder / "last.ckpt").rename(folder / f".last.ckpt.{'c' * 32}.retired")
    counter = _CountSteps()
    resumed = phalanx.Trainer(max_steps=6, callbacks=[counter], **options)
    resumed.fit(Regressor(), train, ckpt_path="auto")
    assert resumed.global_step == 6
    assert counter.batches == 2  # continued from step 4, not from scratch


# ---------------------------------------------------------------------------- a folder phalanx did not write
def _a_sharded_save(source, target):
    save_sharded(
        {"state_dict": {"w": torch.ones(2)}}, target, is_global_zero=True, broadcast=lambda v: v, barrier=lambda n: None
    )


def _publish_a_link(source, target):
    from phalanx.callbacks._checkpoint_files import publish_link

    publish_link(str(source), str(target))


def _copy(source, target):
    TorchCheckpointIO().copy_checkpoint(source, target)


def _one_file_save(source, target):
    TorchCheckpointIO().save_checkpoint({"w": torch.ones(2)}, target)


# every way phalanx puts a checkpoint at a path: none may replace (so delete) a folder without the completion marker
REPLACERS = {
    "one-file save": _one_file_save,
    "sharded save": _a_sharded_save,
    "copy of a file": _copy,
    "copy of a directory": lambda source, target: _copy(source.parent / "sharded.ckpt", target),
    "link (save_last='link')": _publish_a_link,
}
FOREIGN = {
    "no marker": lambda path: None,
    "a marker that is a link": lambda path: os.symlink(path.parent / "elsewhere", path / COMPLETE_MARKER),
    "a marker that is a directory": lambda path: (path / COMPLETE_MARKER).mkdir(),
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
@pytest.mark.parametrize("replacer", sorted(REPLACERS))
def test_nothing_replaces_a_folder_phalanx_did_not_write(tmp_path, replacer, foreign):
    from phalanx.utilities.exceptions import CheckpointWriteError

    source = tmp_path / "epoch=0.ckpt"
    TorchCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, source)
    _a_sharded_save(None, tmp_path / "sharded.ckpt")
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "data.txt").write_text("the user's")
    FOREIGN[foreign](target)
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(CheckpointWriteError, match=rf"Refusing to write a checkpoint at {target}: a directory without"):
        REPLACERS[replacer](source, target)
    assert sorted(p.name for p in target.iterdir()) == before and (target / "data.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0.ckpt", "last.ckpt", "sharded.ckpt"]  # nothing left


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_url_copy_never_replaces_a_folder_without_the_marker(what):
    import uuid

    import fsspec

    from phalanx.utilities.exceptions import CheckpointWriteError

    fs, root = fsspec.filesystem("memory"), f"/foreign-{uuid.uuid4().hex}"
    try:
        source = f"memory://{root}/epoch=0.ckpt"
        if what == "file":
            fs.pipe(f"{root}/epoch=0.ckpt", b"checkpoint")
        else:
            fs.pipe({f"{root}/epoch=0.ckpt/{COMPLETE_MARKER}": b"", f"{root}/epoch=0.ckpt/shard": b"x"})
        fs.pipe(f"{root}/last.ckpt/data.txt", b"the user's")
        with pytest.raises(CheckpointWriteError, match="Refusing to write a checkpoint at memory://.*last.ckpt"):
            TorchCheckpointIO().copy_checkpoint(source, f"memory://{root}/last.ckpt")
        assert fs.cat(f"{root}/last.ckpt/data.txt") == b"the user's"
    finally:
        fs.rm(root, recursive=True)
