"""A disk that fills during a save: every layout (one file, sharded, each through AsyncCheckpointIO too) names the
cause and the file (not torch's "unexpected pos 704 vs 598"), publishes nothing and keeps the previous checkpoint."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx.plugins.io.serialization as serialization
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.collectives import Collectives

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CAPACITY = 600  # bytes a file may take before the (simulated) disk is full


class _FillingFile:
    """A file on a disk with room for CAPACITY bytes: a write past that lands in part, then fails (``ENOSPC``), or,
    as a raw write may, returns the shorter count without an error ("short")."""

    def __init__(self, handle: Any, fault: str) -> None:
        self._handle, self._fault, self._written = handle, fault, 0

    def write(self, data: Any) -> int:
        data = bytes(data)
        room = max(CAPACITY - self._written, 0)
        if len(data) <= room:
            self._written += len(data)
            return self._handle.write(data)
        self._handle.write(data[:room])
        self._written += room
        if self._fault == "short":
            return room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.close()


def _fill_the_disk(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Every checkpoint file written from now on is on the filling disk (one-file writes and DCP's shards)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_open = open
    create_stream = FileSystem.create_stream

    def filling_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        return _FillingFile(handle, fault) if "w" in mode else handle

    @contextlib.contextmanager
    def filling_stream(self: Any, path: Any, mode: str) -> Any:
        with create_stream(self, path, mode) as stream:
            yield _FillingFile(stream, fault) if "w" in mode else stream

    monkeypatch.setattr(serialization, "open", filling_open, raising=False)
    monkeypatch.setattr(FileSystem, "create_stream", filling_stream)
    from torch.distributed.checkpoint import _fsspec_filesystem

    url_stream = _fsspec_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def filling_url_stream(self: Any, path: Any, mode: str) -> Any:
        with url_stream(self, path, mode) as stream:
            yield _FillingFile(stream, fault) if "w" in mode else stream

    monkeypatch.setattr(_fsspec_filesystem.FileSystem, "create_stream", filling_url_stream)


def _checkpoint(step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.full((64, 64), float(step))}}


def _one_file(io: Any, checkpoint: dict[str, Any], path: Path) -> None:
    io.save_checkpoint(checkpoint, path)
    if isinstance(io, AsyncCheckpointIO):
        io.wait()


def _sharded(io: Any, checkpoint: dict[str, Any], path: Path) -> None:
    io.save_sharded_checkpoint(checkpoint, path, collectives=Collectives())
    if isinstance(io, AsyncCheckpointIO):
        io.wait()


NOSPACE = r"No space left on device \[ENOSPC\]"
SHORT = r"short write \(\d+ of \d+ bytes reached the file\) \[EIO\]"
# layout, IO, fault -> the message (after the path) that names the cause and the file
CASES = [
    (
        "one file",
        "plain",
        "full",
        rf"Could not write the checkpoint {{path}}: {NOSPACE} \(.*model\.ckpt\); \d+ bytes are free",
    ),
    (
        "one file",
        "async",
        "full",
        rf"background checkpoint save failed: Could not write the checkpoint {{path}}: {NOSPACE}",
    ),
    ("sharded", "plain", "full", rf"Could not write the sharded checkpoint {{path}}: {NOSPACE} \(.*__0_0\.distcp\)"),
    ("sharded", "plain", "short", rf"Could not write the sharded checkpoint {{path}}: {SHORT} \(.*__0_0\.distcp\)"),
    ("sharded", "async", "full", rf"background save of {{path}} failed \(rank 0: {NOSPACE} \(.*__0_0\.distcp\)\)"),
    ("sharded", "async", "short", rf"background save of {{path}} failed \(rank 0: {SHORT} \(.*__0_0\.distcp\)\)"),
    ("sharded at a URL", "plain", "full", rf"sharded checkpoint {{path}}: {NOSPACE} \(.*__0_0\.distcp\)"),
    ("sharded at a URL", "plain", "short", rf"sharded checkpoint {{path}}: {SHORT} \(.*__0_0\.distcp\)"),
]


@pytest.mark.parametrize(("layout", "io_kind", "fault", "expected"), CASES, ids=[" ".join(c[:3]) for c in CASES])
def test_a_full_disk_is_named_and_the_previous_checkpoint_kept(tmp_path, monkeypatch, layout, io_kind, fault, expected):
    save = _one_file if layout == "one file" else _sharded
    io = AsyncCheckpointIO() if io_kind == "async" else TorchCheckpointIO()
    path = tmp_path / "model.ckpt"
    if layout == "sharded at a URL":
        path = f"memory://{tmp_path}/model.ckpt"  # tmp_path only for a name no other test uses
    save(io, _checkpoint(1), path)
    _fill_the_disk(monkeypatch, fault)
    with pytest.raises(Exception, match=expected.format(path=path)) as failed:
        save(io, _checkpoint(2), path)
    assert "unexpected pos" not in str(failed.value)
    monkeypatch.undo()
    io.teardown()
    assert TorchCheckpointIO().load_checkpoint(path)["global_step"] == 1  # the previous checkpoint, whole
    if layout == "sharded at a URL":
        import fsspec

        fs = fsspec.filesystem("memory")
        try:
            assert [entry.rsplit("/", 1)[1] for entry in fs.ls(str(tmp_path), detail=False)] == ["model.ckpt"]
        finally:
            fs.rm(str(tmp_path), recursive=True)
        return
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # nothing half-written left beside it
