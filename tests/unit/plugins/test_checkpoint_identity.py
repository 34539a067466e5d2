"""checkpoint_identity (plugins/io/checkpoint_identity.py): what two ranks compare before they load a checkpoint. Copies
describe alike; every kind of difference (content, size, a missing file, a file in a directory, the kind of thing at
the path) describes differently."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from phalanx.plugins.io.checkpoint_identity import checkpoint_identity


def _checkpoint(path: Path, value: float = 1.0, step: int = 10) -> Path:
    torch.save({"state_dict": {"weight": torch.full((4,), value)}, "global_step": step}, path)
    return path


def _directory(path: Path, value: float = 1.0) -> Path:
    path.mkdir()
    _checkpoint(path / "meta.pt", step=3)
    (path / "shards").mkdir()
    (path / "shards" / "0.distcp").write_bytes(bytes([int(value)]) * 10_000)
    (path / ".complete").write_text("")
    return path


def _copy(source: Path, target: Path) -> None:
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)


# Each row makes the checkpoint the first rank reads and what a second rank reads instead.
def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


DIFFERENT: list[tuple[str, Callable[[Path], Path], Callable[[Path], Path]]] = [
    ("weights", lambda p: _checkpoint(p / "a.ckpt"), lambda p: _checkpoint(p / "a.ckpt", value=2.0)),
    ("step", lambda p: _checkpoint(p / "a.ckpt"), lambda p: _checkpoint(p / "a.ckpt", step=11)),
    ("missing", lambda p: _checkpoint(p / "a.ckpt"), lambda p: p / "a.ckpt"),
    ("size", lambda p: _checkpoint(p / "a.ckpt"), lambda p: _checkpoint(p / "a.ckpt", step=10**30)),
    ("directory-shard", lambda p: _directory(p / "d"), lambda p: _directory(p / "d", value=2.0)),
    ("directory-vs-file", lambda p: _directory(p / "d"), lambda p: _checkpoint(p / "d")),
]


@pytest.mark.parametrize(("first", "second"), [(row[1], row[2]) for row in DIFFERENT], ids=[r[0] for r in DIFFERENT])
def test_different_checkpoints_describe_differently(tmp_path, first, second):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    assert checkpoint_identity(first(tmp_path / "one")) != checkpoint_identity(second(tmp_path / "two"))


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_copies_describe_alike_whatever_their_times(tmp_path, kind):
    source = _checkpoint(tmp_path / "a.ckpt") if kind == "file" else _directory(tmp_path / "d")
    copy = tmp_path / "copy" / source.name
    copy.parent.mkdir()
    _copy(source, copy)
    os.utime(copy, (1, 1))
    assert checkpoint_identity(copy) == checkpoint_identity(source)
    assert checkpoint_identity(str(copy)) == checkpoint_identity(source)


def test_a_file_that_is_no_zip_archive_is_described_by_its_edges(tmp_path):
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(b"\0" * 300_000)
    second.write_bytes(b"\0" * 300_000)
    assert checkpoint_identity(first) == checkpoint_identity(second)
    _flip_last_byte(second)
    assert checkpoint_identity(first) != checkpoint_identity(second)


def test_a_zip_saved_without_checksums_is_told_apart_by_its_metadata(tmp_path):
    from torch.utils.serialization import config

    first, second = tmp_path / "a.ckpt", tmp_path / "b" / "a.ckpt"
    second.parent.mkdir()
    with config.patch({"save.compute_crc32": False}):
        _checkpoint(first)
        _checkpoint(second, step=11)
    assert checkpoint_identity(first) != checkpoint_identity(second)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_what_is_no_file_nor_directory_is_said_without_reading_it(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert checkpoint_identity(fifo) == "not a regular file or directory"  # (reading a FIFO would block)
    assert checkpoint_identity(tmp_path / "nothing") == "nothing at this path"


def test_urls_are_described_as_local_paths_are(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    source = _checkpoint(tmp_path / "a.ckpt")
    with fsspec.open("memory://identity/a.ckpt", "wb") as file:
        file.write(source.read_bytes())
    try:
        assert checkpoint_identity("memory://identity/a.ckpt") == checkpoint_identity(source)
        assert checkpoint_identity("memory://identity/none.ckpt") == "nothing at this path"
        directory = _directory(tmp_path / "d")
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                with fsspec.open(f"memory://identity/d/{path.relative_to(directory)}", "wb") as file:
                    file.write(path.read_bytes())
        assert checkpoint_identity("memory://identity/d") == checkpoint_identity(directory)
    finally:
        fsspec.filesystem("memory").rm("/identity", recursive=True)
