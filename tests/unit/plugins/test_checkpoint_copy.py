"""CheckpointIO.copy_checkpoint: a finished checkpoint (one file, or a sharded directory) put at a second name
atomically, locally and through fsspec, without changing the source."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.directory import COMPLETE_MARKER
from phalanx.plugins.io.formats.dcp import save_sharded


def _checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {"weight": torch.full((3, 2), value)}, "global_step": int(value), "epoch": 0}


def _write_file(path: Path, value: float) -> None:
    TorchCheckpointIO().save_checkpoint(_checkpoint(value), path)


def _write_sharded(path: Path, value: float) -> None:
    save_sharded(_checkpoint(value), path, is_global_zero=True, broadcast=lambda x: x, barrier=lambda name: None)


def _step(path: Any) -> int:
    return TorchCheckpointIO().load_checkpoint(path)["global_step"]


def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# (id, how the source is written, what is at the target before: None, a file or a sharded directory)
LOCAL_CASES = [
    ("file to a new name", _write_file, None),
    ("file over an older file", _write_file, _write_file),
    ("file over an older directory", _write_file, _write_sharded),
    ("directory to a new name", _write_sharded, None),
    ("directory over an older directory", _write_sharded, _write_sharded),
    ("directory over an older file", _write_sharded, _write_file),
]


@pytest.mark.parametrize(("write", "before"), [c[1:] for c in LOCAL_CASES], ids=[c[0] for c in LOCAL_CASES])
def test_a_local_copy_loads_equal_and_leaves_the_source_and_nothing_else(tmp_path, write, before):
    source, target = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    write(source, 5.0)
    if before is not None:
        before(target, 1.0)
    original = _snapshot(source)
    TorchCheckpointIO().copy_checkpoint(source, target)
    assert _step(target) == 5
    assert _snapshot(source) == original
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt", "last.ckpt"]  # no temporary or retired copy left
    if target.is_dir():
        assert (target / COMPLETE_MARKER).is_file()
        # The copy's marker is its own (written last); removing the copy leaves the source whole.
        assert os.stat(target / COMPLETE_MARKER).st_ino != os.stat(source / COMPLETE_MARKER).st_ino
        TorchCheckpointIO().remove_checkpoint(target)
        assert _snapshot(source) == original and _step(source) == 5


def test_a_directory_copy_shares_the_shard_files_where_the_file_system_allows(tmp_path):
    source, target = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    _write_sharded(source, 2.0)
    TorchCheckpointIO().copy_checkpoint(source, target)
    shards = [p for p in source.rglob("*.distcp")]
    assert shards
    assert all(os.stat(p).st_ino == os.stat(target / p.relative_to(source)).st_ino for p in shards)


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_a_copy_on_an_fsspec_file_system(layout):
    fs = fsspec.filesystem("memory")
    root = f"memory://copy-{uuid.uuid4().hex}"
    source, target = f"{root}/epoch=1.ckpt", f"{root}/last.ckpt"
    if layout == "file":
        TorchCheckpointIO().save_checkpoint(_checkpoint(4.0), source)
    else:
        for name, data in (("a.bin", b"1"), ("sub/b.bin", b"2"), (COMPLETE_MARKER, b"")):
            fs.pipe(f"{source[len('memory://') :]}/{name}", data)
    try:
        TorchCheckpointIO().copy_checkpoint(source, target)
        TorchCheckpointIO().copy_checkpoint(source, target)  # over the previous copy
        if layout == "file":
            assert _step(target) == 4
        else:
            assert fs.cat(f"{target[len('memory://') :]}/sub/b.bin") == b"2"
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root[len("memory://") :], detail=False)) == [
            "epoch=1.ckpt",
            "last.ckpt",
        ]
    finally:
        fs.rm(root[len("memory://") :], recursive=True)


BAD_CASES = [
    ("missing source", "absent.ckpt", "last.ckpt", FileNotFoundError, "absent.ckpt"),
    ("across file systems", "memory://x/a.ckpt", "file:///tmp/b.ckpt", ValueError, "different file systems"),
]


@pytest.mark.parametrize(
    ("source", "target", "error", "match"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_a_copy_that_cannot_be_made_names_the_checkpoint(tmp_path, source, target, error, match):
    if "://" not in source:
        source, target = tmp_path / source, tmp_path / target
    else:
        fsspec.filesystem("memory").pipe("/x/a.ckpt", b"data")
    with pytest.raises(error, match=match):
        TorchCheckpointIO().copy_checkpoint(source, target)
    if "://" not in str(source):
        assert os.listdir(tmp_path) == []


def test_a_copy_onto_its_own_source_changes_nothing(tmp_path):
    source = tmp_path / "epoch=1.ckpt"
    _write_file(source, 3.0)
    original = source.read_bytes()
    TorchCheckpointIO().copy_checkpoint(source, tmp_path / "." / "epoch=1.ckpt")
    assert source.read_bytes() == original and os.listdir(tmp_path) == ["epoch=1.ckpt"]


def test_an_async_io_copies_after_the_save_it_queued(tmp_path):
    io = AsyncCheckpointIO()
    source, target = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(6.0), source)
    io.copy_checkpoint(source, target)  # queued: the save may still be writing the source
    io.teardown()
    assert _step(target) == 6
