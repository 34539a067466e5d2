"""Streamed checkpoint writes and reads: a save never holds a second copy of the state, an interrupted save leaves the
previous checkpoint whole, and a lazy (memory-mapped) load refuses truncated files and archives that lie about sizes.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch

import phalanx.plugins.io.serialization as serialization
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError

STATE_BYTES = 64 << 20  # the state of the memory tests: ~64 MiB in 16 tensors
MiB = 1 << 20


def _state(value: float, *, tensors: int = 4, numel: int = 1 << 16) -> dict[str, Any]:
    return {
        "global_step": int(value),
        "state_dict": {f"w{i}": torch.full((numel,), float(value)) for i in range(tensors)},
    }


def _left_beside(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.parent.iterdir())


# ------------------------------------------------------------------ an interrupted streamed write
class _RaisingOnPickle:
    """Raises from inside torch's pickler, after the tensors before it were reached."""

    def __reduce__(self) -> Any:
        raise RuntimeError("raised while pickling")


class _InterruptingFile:
    """A file that receives ``limit`` bytes, then raises ``error`` from the write in progress."""

    def __init__(self, handle: Any, error: BaseException, limit: int) -> None:
        self._handle, self._error, self._left = handle, error, limit

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._left:
            self._handle.write(memoryview(data).cast("B")[: self._left])
            raise self._error
        self._left -= size
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _InterruptingFile:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.close()


def _interrupt_writes(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    real_open = open

    def interrupting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        return _InterruptingFile(handle, error, limit=100_000) if "w" in mode else handle

    monkeypatch.setattr(serialization, "open", interrupting_open, raising=False)


FAILURES: list[tuple[str, Callable[[pytest.MonkeyPatch, dict[str, Any]], type[BaseException]]]] = [
    ("an error from the pickler", lambda mp, state: (state.update(bad=_RaisingOnPickle()), RuntimeError)[1]),
    ("an interrupt mid-write", lambda mp, state: (_interrupt_writes(mp, KeyboardInterrupt()), KeyboardInterrupt)[1]),
    ("a non-OS error mid-write", lambda mp, state: (_interrupt_writes(mp, ValueError("bad")), ValueError)[1]),
]


@pytest.mark.parametrize("previous", [True, False], ids=["over a checkpoint", "new name"])
@pytest.mark.parametrize(("name", "fail"), FAILURES, ids=[name for name, _ in FAILURES])
def test_a_failure_during_a_streamed_write_keeps_the_previous_file_and_leaves_nothing(
    tmp_path, monkeypatch, previous, name, fail
):
    path = tmp_path / "last.ckpt"
    io_ = TorchCheckpointIO()
    if previous:
        io_.save_checkpoint(_state(1), path)
    state = _state(2)
    expected = fail(monkeypatch, state)
    with pytest.raises(expected):
        io_.save_checkpoint(state, path)
    monkeypatch.undo()
    assert _left_beside(path) == (["last.ckpt"] if previous else [])  # no temporary, nothing under the final name
    if previous:
        assert io_.load_checkpoint(path)["global_step"] == 1


_KILLED_CHILD = """
import os, sys, torch
import phalanx.plugins.io.serialization as serialization
import phalanx.plugins.io.torch_io as torch_io
real_open = open
class Dying:
    def __init__(self, handle): self._handle, self._left = handle, 100_000
    def write(self, data):
        size = memoryview(data).nbytes
        if size > self._left:
            self._handle.write(memoryview(data).cast("B")[: self._left]); self._handle.flush()
            os._exit(17)  # killed mid-write: no cleanup of any kind runs
        self._left -= size
        return self._handle.write(data)
    def __getattr__(self, name): return getattr(self._handle, name)
    def __enter__(self): return self
    def __exit__(self, *a): self._handle.close()
def dying_open(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    return Dying(handle) if "w" in mode else handle
serialization.open = dying_open
state = {"global_step": 2, "state_dict": {f"w{i}": torch.full((1 << 16,), 2.0) for i in range(4)}}
torch_io.TorchCheckpointIO().save_checkpoint(state, sys.argv[1])
"""


@pytest.mark.parametrize("previous", [True, False], ids=["over a checkpoint", "new name"])
def test_a_process_killed_during_a_streamed_write_leaves_the_previous_file_or_none(tmp_path, previous):
    path = tmp_path / "last.ckpt"
    if previous:
        TorchCheckpointIO().save_checkpoint(_state(1), path)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_CHILD), str(path)], capture_output=True, timeout=120
    )
    assert child.returncode == 17, child.stderr.decode()[-2000:]
    partial = [name for name in _left_beside(path) if name != "last.ckpt"]
    assert len(partial) == 1 and partial[0].startswith(".last.ckpt.") and partial[0].endswith(".tmp")  # hidden
    assert (tmp_path / partial[0]).stat().st_size >= 100_000  # the kill came mid-write, not before it
    if previous:
        assert TorchCheckpointIO().load_checkpoint(path)["global_step"] == 1  # the old file, whole
    else:
        assert not path.exists()


# ------------------------------------------------------------------ lazy (memory-mapped) loads
def test_a_lazy_load_returns_the_tensors_copy_on_write(tmp_path):
    path = tmp_path / "big.ckpt"
    TorchCheckpointIO().save_checkpoint(_state(3), path)
    lazy = TorchCheckpointIO().load_checkpoint(path, mmap=True)
    torch.testing.assert_close(lazy["state_dict"], _state(3)["state_dict"])
    lazy["state_dict"]["w0"].add_(1.0)  # changes the copy in memory only
    assert TorchCheckpointIO().load_checkpoint(path)["state_dict"]["w0"].eq(3.0).all()


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("mmap", [True, False], ids=["lazily", "whole"])
def test_a_truncated_file_is_refused_naming_it(tmp_path, keep, mmap):
    path = tmp_path / "cut.ckpt"
    TorchCheckpointIO().save_checkpoint(_state(4), path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=rf"{path}.*(truncated|claim)"):
        TorchCheckpointIO().load_checkpoint(path, mmap=mmap)


def _lying(data: bytes, claim: int) -> bytes:
    """``data`` (an archive whose first storage holds 255 uint8 elements) with data.pkl claiming ``claim`` of them."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            content = source.read(info.filename)
            if info.filename.endswith("data.pkl"):
                head, first, *rest = content.split(b"K\xff")
                content = b"K\xff".join([head + b"J" + struct.pack("<i", claim) + first, *rest])
            archive.writestr(info, content)
    return out.getvalue()


@pytest.mark.parametrize("claim", [256, 300, 4000, 20_000, 1 << 29], ids=lambda c: f"claims {c} bytes")
def test_an_archive_whose_storage_claims_more_than_its_record_is_refused_when_mapped(tmp_path, claim):
    honest = io.BytesIO()
    # The storage after the lying one makes room in the file: without the check, the tensor would show its bytes.
    torch.save({"w": torch.zeros(255, dtype=torch.uint8), "after": torch.ones(8000, dtype=torch.uint8)}, honest)
    path = tmp_path / "lies.ckpt"
    path.write_bytes(_lying(honest.getvalue(), claim))
    with pytest.raises(CheckpointError, match=rf"Refusing to load {path}|{path} is not a checkpoint torch can read"):
        TorchCheckpointIO().load_checkpoint(path, mmap=True)
    with pytest.raises(CheckpointError, match=str(path)):
        TorchCheckpointIO().load_checkpoint(path)


# ------------------------------------------------------------------ no second copy of the state
def _big_state() -> dict[str, Any]:
    return {"global_step": 5, "state_dict": {f"w{i}": torch.ones(STATE_BYTES // 16 // 4) for i in range(16)}}


def _python_heap_peak(step: Callable[[], None]) -> int:
    tracemalloc.start()
    try:
        step()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _save_async(state: dict[str, Any], path: Any) -> None:
    io_ = AsyncCheckpointIO(reuse_staging_buffers=False)
    io_.save_checkpoint(state, path)
    io_.teardown()


SAVES = [
    ("local file", lambda state, tmp: TorchCheckpointIO().save_checkpoint(state, tmp / "m.ckpt"), 0.0),
    ("async", lambda state, tmp: _save_async(state, tmp / "m.ckpt"), 0.0),
    # The memory filesystem keeps the file in memory, and its move copies it: those two copies are its own.
    ("memory URL", lambda state, tmp: TorchCheckpointIO().save_checkpoint(state, _memory_url(tmp)), 2.0),
]


def _memory_url(tmp: Path) -> str:
    return f"memory:///phalanx-stream-{uuid.uuid4().hex}/m.ckpt"


@pytest.mark.parametrize(("where", "save", "file_copies"), SAVES, ids=[s[0] for s in SAVES])
def test_a_save_allocates_no_second_copy_of_the_state(tmp_path, where, save, file_copies):
    """tracemalloc sees every Python buffer (an in-memory serialisation, a bytes copy), not the tensors' memory."""
    state = _big_state()
    peak = _python_heap_peak(lambda: save(state, tmp_path))
    assert peak < (file_copies + 0.1) * STATE_BYTES + 8 * MiB, f"{where}: {peak / MiB:.1f} MiB of Python buffers"
    fs = fsspec.filesystem("memory")
    for root in fs.ls("/", detail=False):
        if "phalanx-stream-" in root:
            fs.rm(root, recursive=True)


@pytest.mark.parametrize("mmap", [True, False], ids=["lazily", "whole"])
def test_a_load_reads_the_file_without_buffering_it(tmp_path, mmap):
    path = tmp_path / "m.ckpt"
    TorchCheckpointIO().save_checkpoint(_big_state(), path)
    loaded: list[Any] = []
    peak = _python_heap_peak(lambda: loaded.append(TorchCheckpointIO().load_checkpoint(path, mmap=mmap)))
    assert peak < 0.1 * STATE_BYTES, f"{peak / MiB:.1f} MiB of Python buffers"
    assert loaded[0]["state_dict"]["w15"].eq(1.0).all()


def test_a_url_load_streams_from_the_file_system(tmp_path):
    url = _memory_url(tmp_path)
    TorchCheckpointIO().save_checkpoint(_big_state(), url)
    try:
        loaded: list[Any] = []
        peak = _python_heap_peak(lambda: loaded.append(TorchCheckpointIO().load_checkpoint(url, mmap=True)))
        assert peak < 0.5 * STATE_BYTES, f"{peak / MiB:.1f} MiB of Python buffers"
        assert loaded[0]["state_dict"]["w3"].eq(1.0).all()
    finally:
        fsspec.filesystem("memory").rm(url.split("://", 1)[1].rsplit("/", 1)[0], recursive=True)


def test_saves_and_loads_never_build_the_whole_file_in_a_bytes_buffer(tmp_path, monkeypatch):
    """Counts BytesIO buffers that grow past a quarter of the state (the old in-memory serialisation did)."""
    grown: list[int] = []
    real = io.BytesIO

    class CountingBytesIO(real):  # type: ignore[misc,valid-type]
        def write(self, data: Any) -> int:
            written = super().write(data)
            if self.tell() > STATE_BYTES // 4:
                grown.append(self.tell())
            return written

    monkeypatch.setattr(io, "BytesIO", CountingBytesIO)
    path = tmp_path / "m.ckpt"
    TorchCheckpointIO().save_checkpoint(_big_state(), path)
    TorchCheckpointIO().load_checkpoint(path)
    assert not grown
    assert os.path.getsize(path) > STATE_BYTES


# ------------------------------------------------------------------ the plain part of a sharded checkpoint
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["local", "memory URL"])
def test_a_sharded_checkpoints_plain_part_streams_into_its_meta_file(tmp_path, where, monkeypatch):
    """The meta file (every value that is not a tensor) is written as it serialises, never assembled as a whole zip
    archive in a bytes buffer first (the old code did, then wrote the buffer)."""
    from phalanx.plugins.io.collectives import Collectives
    from phalanx.plugins.io.sharded_io import save_sharded_checkpoint

    archives: dict[int, int] = {}  # zip archives built in bytes buffers: their sizes
    real = io.BytesIO

    class WatchedBytesIO(real):  # type: ignore[misc,valid-type]
        def write(self, data: Any) -> int:
            if self.tell() == 0 and bytes(memoryview(data)[:4]) == b"PK\x03\x04":
                archives[id(self)] = 0
            written = super().write(data)
            if id(self) in archives:
                archives[id(self)] = self.tell()
            return written

    root = str(tmp_path) if where == "local" else f"memory:///phalanx-stream-{uuid.uuid4().hex}"
    target = f"{root}/sharded"
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.arange(8.0)}, "notes": b"n" * MiB}
    try:
        monkeypatch.setattr(io, "BytesIO", WatchedBytesIO)
        save_sharded_checkpoint(checkpoint, target, collectives=Collectives())
        monkeypatch.undo()
        # The memory filesystem's files are bytes buffers themselves: those are the files, not a copy made before.
        files = {id(stored) for stored in fsspec.filesystem("memory").store.values()}
        buffered = [size for key, size in archives.items() if key not in files]
        assert max(buffered, default=0) < MiB, "the meta file was assembled in memory before it was written"
        loaded = TorchCheckpointIO().load_checkpoint(target)
        assert loaded["notes"] == checkpoint["notes"] and loaded["state_dict"]["w"].equal(torch.arange(8.0))
    finally:
        if where != "local":
            fsspec.filesystem("memory").rm(root.split("://", 1)[1], recursive=True)
