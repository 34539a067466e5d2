"""TorchCheckpointIO and AsyncCheckpointIO: round trips, atomic writes, clear errors, background saves."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError


class SomeCustomClass:
    """Not a tensor or a plain value: loading it needs arbitrary unpickling."""

    def __init__(self) -> None:
        self.value = 3


def _checkpoint(value: float = 1.0) -> dict[str, Any]:
    return {
        "state_dict": {"weight": torch.full((2, 3), value), "step": torch.tensor(7)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "epoch": 2,
        "name": "run",
        "pair": (1, None),
        "ok": True,
    }


def _assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    torch.testing.assert_close(loaded["state_dict"], expected["state_dict"])
    assert {k: v for k, v in loaded.items() if k != "state_dict"} == {
        k: v for k, v in expected.items() if k != "state_dict"
    }


@pytest.fixture
def memory_url() -> str:
    root = f"/phalanx-test-{uuid.uuid4().hex}"
    yield f"memory://{root}/sub/ckpt.pt"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ------------------------------------------------------------------ round trips


def test_round_trip_local_path_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "last.ckpt"
    checkpoint = _checkpoint()
    TorchCheckpointIO().save_checkpoint(checkpoint, path)
    loaded = TorchCheckpointIO().load_checkpoint(path)
    _assert_same(loaded, checkpoint)
    assert torch.load(path, weights_only=True)["epoch"] == 2  # a plain torch.save file
    assert os.listdir(path.parent) == ["last.ckpt"]  # no temporary left behind


def test_round_trip_accepts_str_paths_and_overwrites(tmp_path: Path) -> None:
    path = str(tmp_path / "c.ckpt")
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)
    io.save_checkpoint(_checkpoint(5.0), path)
    assert io.load_checkpoint(path)["state_dict"]["weight"][0, 0].item() == 5.0


def test_load_maps_to_cpu_by_default_and_honours_map_location(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    assert TorchCheckpointIO().load_checkpoint(path)["state_dict"]["weight"].device.type == "cpu"
    loaded = TorchCheckpointIO().load_checkpoint(path, map_location="meta")
    assert loaded["state_dict"]["weight"].device.type == "meta"


def test_round_trip_memory_url(memory_url: str) -> None:
    io = TorchCheckpointIO()
    checkpoint = _checkpoint(4.0)
    io.save_checkpoint(checkpoint, memory_url)
    _assert_same(io.load_checkpoint(memory_url), checkpoint)
    fs = fsspec.filesystem("memory")
    parent = memory_url[len("memory://") :].rsplit("/", 1)[0]
    assert [entry.rsplit("/", 1)[-1] for entry in fs.ls(parent, detail=False)] == ["ckpt.pt"]  # no temporary left


def test_storage_options_are_refused_for_local_paths(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        TorchCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "x.ckpt", storage_options={"anon": True})
    assert not (tmp_path / "x.ckpt").exists()


# ------------------------------------------------------------------ atomic writes


def test_failed_rename_keeps_previous_checkpoint_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk vanished mid-save")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk vanished"):
        io.save_checkpoint(_checkpoint(2.0), path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["state_dict"]["weight"][0, 0].item() == 1.0
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_failed_write_keeps_previous_checkpoint_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)

    def crash(fd: int) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="fsync failed"):
        io.save_checkpoint(_checkpoint(2.0), path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["state_dict"]["weight"][0, 0].item() == 1.0
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)
    monkeypatch.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(_checkpoint(2.0), path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["state_dict"]["weight"][0, 0].item() == 1.0
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_failed_fsspec_move_keeps_previous_checkpoint_and_leaves_no_temporary(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), memory_url)
    fs_class = type(fsspec.filesystem("memory"))

    def crash(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError("connection reset")

    monkeypatch.setattr(fs_class, "mv", crash)
    with pytest.raises(OSError, match="connection reset"):
        io.save_checkpoint(_checkpoint(2.0), memory_url)
    monkeypatch.undo()
    assert io.load_checkpoint(memory_url)["state_dict"]["weight"][0, 0].item() == 1.0
    fs = fsspec.filesystem("memory")
    parent = memory_url[len("memory://") :].rsplit("/", 1)[0]
    assert [entry.rsplit("/", 1)[-1] for entry in fs.ls(parent, detail=False)] == ["ckpt.pt"]


# ------------------------------------------------------------------ clear errors


def test_loading_arbitrary_objects_raises_unsafe_checkpoint_error_naming_the_class(tmp_path: Path) -> None:
    path = tmp_path / "unsafe.ckpt"
    torch.save({"x": SomeCustomClass(), "w": torch.ones(1)}, path)
    with pytest.raises(UnsafeCheckpointError) as error:
        TorchCheckpointIO().load_checkpoint(path)
    message = str(error.value)
    assert "SomeCustomClass" in message
    assert "weights_only" in message
    assert "arbitrary code" in message
    assert str(path) in message
    assert isinstance(error.value, CheckpointError)


def test_loading_a_reference_to_a_function_is_unsafe(tmp_path: Path) -> None:
    class RunsCode:
        def __reduce__(self) -> tuple:
            return (os.getcwd, ())

    path = tmp_path / "evil.ckpt"
    torch.save({"x": RunsCode()}, path)
    with pytest.raises(UnsafeCheckpointError, match="getcwd"):
        TorchCheckpointIO().load_checkpoint(path)


def test_missing_path_raises_file_not_found(tmp_path: Path, memory_url: str) -> None:
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        TorchCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError):
        TorchCheckpointIO().load_checkpoint(memory_url)


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint", b"\0" * 64, bytes(range(256))])
def test_garbage_file_raises_checkpoint_error_not_unsafe(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="garbage.ckpt") as error:
        TorchCheckpointIO().load_checkpoint(path)
    assert not isinstance(error.value, UnsafeCheckpointError)  # garbage is not an arbitrary-code checkpoint


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_truncated_checkpoint_raises_checkpoint_error(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "full.ckpt"
    TorchCheckpointIO().save_checkpoint({"w": torch.randn(64, 64), "step": 3}, path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="truncated.ckpt") as error:
        TorchCheckpointIO().load_checkpoint(truncated)
    assert not isinstance(error.value, UnsafeCheckpointError)


def test_a_checkpoint_that_is_not_a_dict_raises_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "list.ckpt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointError, match="holds a list"):
        TorchCheckpointIO().load_checkpoint(path)


def test_loading_a_directory_raises_checkpoint_error(tmp_path: Path, memory_url: str) -> None:
    (tmp_path / "sharded").mkdir()
    with pytest.raises(CheckpointError, match="directory"):
        TorchCheckpointIO().load_checkpoint(tmp_path / "sharded")
    fsspec.filesystem("memory").makedirs(memory_url[len("memory://") :], exist_ok=True)
    with pytest.raises(CheckpointError, match="directory"):
        TorchCheckpointIO().load_checkpoint(memory_url)


# ------------------------------------------------------------------ removal


def test_remove_checkpoint_file_directory_and_missing(tmp_path: Path) -> None:
    io = TorchCheckpointIO()
    file = tmp_path / "a.ckpt"
    io.save_checkpoint(_checkpoint(), file)
    io.remove_checkpoint(file)
    assert not file.exists()
    directory = tmp_path / "sharded"
    (directory / "inner").mkdir(parents=True)
    (directory / "inner" / "shard0.pt").write_bytes(b"x")
    io.remove_checkpoint(str(directory))
    assert not directory.exists()
    io.remove_checkpoint(tmp_path / "never-existed.ckpt")  # no error
    assert os.listdir(tmp_path) == []


def test_remove_checkpoint_memory_url(memory_url: str) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(), memory_url)
    io.remove_checkpoint(memory_url)
    assert not fsspec.filesystem("memory").exists(memory_url[len("memory://") :])
    io.remove_checkpoint(memory_url)  # already gone: no error


# ------------------------------------------------------------------ AsyncCheckpointIO


class _FailingIO(CheckpointIO):
    def __init__(self) -> None:
        self.torn_down = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        raise OSError(f"cannot write {path}")

    def load_checkpoint(self, path: Any, map_location: Any | None = None) -> dict[str, Any]:
        return {}

    def remove_checkpoint(self, path: Any) -> None:
        pass

    def teardown(self) -> None:
        self.torn_down = True


class _GatedIO(TorchCheckpointIO):
    """Saves only once ``gate`` is set, so the test controls when the background write happens."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        assert self.gate.wait(5), "the test never opened the gate"
        super().save_checkpoint(checkpoint, path, storage_options)


def _wait_for_background(io: AsyncCheckpointIO) -> None:
    concurrent.futures.wait(list(io._pending), timeout=5)


def test_async_round_trip(tmp_path: Path) -> None:
    io = AsyncCheckpointIO()
    checkpoint = _checkpoint(3.0)
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    _assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), checkpoint)
    io.teardown()
    assert io._executor is None


def test_async_snapshot_is_taken_at_call_time(tmp_path: Path) -> None:
    inner = _GatedIO()
    io = AsyncCheckpointIO(inner)
    weight = torch.zeros(3)
    io.save_checkpoint({"state_dict": {"w": weight}, "nested": [weight]}, tmp_path / "a.ckpt")
    weight.add_(100.0)  # the optimizer keeps updating parameters in place while the write is pending
    inner.gate.set()
    io.wait()
    loaded = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], torch.zeros(3))
    assert torch.equal(loaded["nested"][0], torch.zeros(3))
    io.teardown()


def test_async_load_waits_for_pending_saves(tmp_path: Path) -> None:
    inner = _GatedIO()
    io = AsyncCheckpointIO(inner)
    path = tmp_path / "late.ckpt"
    io.save_checkpoint(_checkpoint(9.0), path)
    assert not path.exists()  # still queued behind the gate
    threading.Timer(0.05, inner.gate.set).start()
    assert io.load_checkpoint(path)["state_dict"]["weight"][0, 0].item() == 9.0
    io.teardown()


def test_async_remove_waits_for_pending_saves(tmp_path: Path) -> None:
    inner = _GatedIO()
    io = AsyncCheckpointIO(inner)
    path = tmp_path / "gone.ckpt"
    io.save_checkpoint(_checkpoint(), path)
    threading.Timer(0.05, inner.gate.set).start()
    io.remove_checkpoint(path)
    assert not path.exists()  # removed after the write, not before it
    io.teardown()


def test_async_background_error_is_reraised_at_the_next_save(tmp_path: Path) -> None:
    io = AsyncCheckpointIO(_FailingIO())
    io.save_checkpoint(_checkpoint(), tmp_path / "first.ckpt")  # returns at once: the failure happens later
    _wait_for_background(io)
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*first.ckpt") as error:
        io.save_checkpoint(_checkpoint(), tmp_path / "second.ckpt")
    assert isinstance(error.value.__cause__, OSError)
    assert io._pending == []  # the failed save was reported once and the second one was refused, not queued
    io.teardown()
    assert not (tmp_path / "second.ckpt").exists()


def test_async_background_error_is_reraised_at_teardown(tmp_path: Path) -> None:
    inner = _FailingIO()
    io = AsyncCheckpointIO(inner)
    io.save_checkpoint(_checkpoint(), tmp_path / "only.ckpt")
    with pytest.raises(RuntimeError, match="only.ckpt"):
        io.teardown()
    assert io._executor is None  # the thread is stopped even though teardown raised
    assert inner.torn_down
    io.teardown()  # the error was reported once; a second teardown is quiet


def test_async_rejects_non_checkpoint_io() -> None:
    with pytest.raises(TypeError, match="CheckpointIO"):
        AsyncCheckpointIO(object())  # type: ignore[arg-type]
    assert isinstance(AsyncCheckpointIO().checkpoint_io, TorchCheckpointIO)
