"""Every layout through CheckpointIO in one process: layout detection, sharded (DCP) directories locally and at
fsspec URLs (memory://), removal, and AsyncCheckpointIO's background sharded saves (early return, errors kept)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx.plugins.io.sharded_io as sharded_io
from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((4, 3), value), "b": torch.arange(3.0) + value}, "global_step": int(value)}


class MinimalIO(CheckpointIO):
    """A user's IO written before the directory methods existed: only the three abstract methods."""

    def __init__(self) -> None:
        self.inner = TorchCheckpointIO()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)


def _location(tmp_path: Path, where: str) -> str:
    if where == "local":
        return str(tmp_path / "run" / "a.ckpt")
    return f"memory://{uuid.uuid4().hex}/run/a.ckpt"


# ---------------------------------------------------------------------------- layout detection
def _make(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "ckpt"
    if kind == "file":
        TorchCheckpointIO().save_checkpoint(_checkpoint(1), path)
        return path
    path.mkdir()
    names = {
        "sharded": [".metadata", "phalanx_meta.pt", ".complete"],
        "sharded without marker": [".metadata", "phalanx_meta.pt"],
        "deepspeed": ["phalanx_deepspeed_state.pt", "latest", ".complete"],
        "deepspeed without marker": ["phalanx_deepspeed_state.pt", "latest"],
        "half a sharded one": [".metadata", ".complete"],
        "empty directory": [],
    }[kind]
    for name in names:
        (path / name).write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("file", "file"),
        ("sharded", "sharded"),
        ("deepspeed", "deepspeed"),
        ("sharded without marker", "incomplete sharded checkpoint: it has no .complete marker"),
        ("deepspeed without marker", "incomplete deepspeed checkpoint: it has no .complete marker"),
        ("half a sharded one", "not a complete checkpoint"),
        ("empty directory", "found: none of them"),
    ],
)
def test_checkpoint_layout_names_the_layout_or_refuses_an_incomplete_directory(tmp_path, kind, expected):
    path = _make(tmp_path, kind)
    if expected in ("file", "sharded", "deepspeed"):
        assert checkpoint_layout(path) == expected
        return
    with pytest.raises(CheckpointError, match=expected) as error:
        checkpoint_layout(path)
    assert str(path) in str(error.value)
    if "marker" in expected:  # TorchCheckpointIO refuses to read it whole, too
        with pytest.raises(CheckpointError, match="incomplete"):
            TorchCheckpointIO().load_checkpoint(path)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_checkpoint_layout_of_a_missing_path_is_file_not_found(tmp_path, where):
    with pytest.raises(FileNotFoundError, match="a.ckpt"):
        checkpoint_layout(_location(tmp_path, where))


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"rank": 2, "world_size": 2}, "rank must be an int in"),
        ({"rank": -1}, "rank must be an int in"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"rank": "0"}, "rank must be an int"),
    ],
)
def test_collectives_refuse_impossible_ranks(arguments, message):
    with pytest.raises(ValueError, match=message):
        Collectives(**arguments)


# ---------------------------------------------------------------------------- sharded directories through any IO
@pytest.mark.parametrize("io_type", [TorchCheckpointIO, MinimalIO, AsyncCheckpointIO])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_sharded_checkpoint_saves_loads_replaces_and_removes_through_the_io(tmp_path, where, io_type):
    io, path = io_type(), _location(tmp_path, where)
    for value in (1.0, 2.0):  # the second save replaces the first
        io.save_sharded_checkpoint(_checkpoint(value), path, collectives=Collectives())
        if isinstance(io, AsyncCheckpointIO):
            io.wait()
        assert checkpoint_layout(path) == "sharded"
    whole = io.load_checkpoint(path)
    torch.testing.assert_close(whole["state_dict"], _checkpoint(2.0)["state_dict"])
    assert whole["global_step"] == 2
    live = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    loaded = io.load_sharded_checkpoint(path, module_state=live, optimizers=[])
    torch.testing.assert_close(live, _checkpoint(2.0)["state_dict"])
    assert loaded["global_step"] == 2
    io.remove_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        checkpoint_layout(path)
    if where == "local":
        assert list((tmp_path / "run").iterdir()) == []  # no staging or retired directory left behind
    io.teardown()


def test_sharded_storage_options_on_a_local_path_are_refused(tmp_path):
    with pytest.raises(TypeError, match="storage_options are only used for fsspec URLs"):
        TorchCheckpointIO().save_sharded_checkpoint(
            _checkpoint(1), tmp_path / "a.ckpt", collectives=Collectives(), storage_options={"x": 1}
        )


def test_loading_a_one_file_checkpoint_as_sharded_names_the_layout(tmp_path):
    TorchCheckpointIO().save_checkpoint(_checkpoint(1), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointError, match="is a file checkpoint, not a sharded"):
        TorchCheckpointIO().load_sharded_checkpoint(tmp_path / "a.ckpt", module_state={}, optimizers=[])


# ---------------------------------------------------------------------------- asynchronous sharded saves
@pytest.fixture
def slowed_writes(monkeypatch):
    """DCP's writes wait for the returned event: a save is 'in flight' until the test sets it."""
    release = threading.Event()
    original = sharded_io.storage_writer

    def slowed(staging: Any, storage_options: Any | None = None) -> Any:
        writer = original(staging, storage_options)
        write_data = writer.write_data

        def write_later(plan: Any, planner: Any) -> Any:
            assert release.wait(30), "the test never released the write"
            return write_data(plan, planner)

        writer.write_data = write_later
        return writer

    monkeypatch.setattr(sharded_io, "storage_writer", slowed)
    yield release
    release.set()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_an_async_sharded_save_returns_while_the_write_is_pending_and_keeps_the_staged_values(
    tmp_path, where, slowed_writes
):
    io, path = AsyncCheckpointIO(), _location(tmp_path, where)
    checkpoint = _checkpoint(1.0)
    io.save_sharded_checkpoint(checkpoint, path, collectives=Collectives())
    with pytest.raises(FileNotFoundError):  # returned, nothing published yet
        checkpoint_layout(path)
    checkpoint["state_dict"]["w"].add_(100.0)  # training goes on, in place
    slowed_writes.set()
    io.wait()
    torch.testing.assert_close(io.load_checkpoint(path)["state_dict"], _checkpoint(1.0)["state_dict"])
    io.teardown()


class FailingPublish(TorchCheckpointIO):
    def finish_directory_checkpoint(self, staging: Any, path: Any, *, collectives: Collectives) -> None:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("surfaces_at", ["next save", "teardown"])
def test_a_failed_background_sharded_save_is_raised_later_and_keeps_the_previous_checkpoint(tmp_path, surfaces_at):
    path = tmp_path / "a.ckpt"
    TorchCheckpointIO().save_sharded_checkpoint(_checkpoint(1.0), path, collectives=Collectives())
    io = AsyncCheckpointIO(FailingPublish())
    io.save_sharded_checkpoint(_checkpoint(2.0), path, collectives=Collectives())
    with pytest.raises(RuntimeError, match="No space left on device"):
        if surfaces_at == "next save":
            io.save_sharded_checkpoint(_checkpoint(3.0), path, collectives=Collectives())
        else:
            io.teardown()
    torch.testing.assert_close(TorchCheckpointIO().load_checkpoint(path)["state_dict"], _checkpoint(1.0)["state_dict"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # the failed staging directory is gone
    io.teardown()


def test_a_failed_background_write_raises_a_checkpoint_write_error_naming_the_path(tmp_path, monkeypatch):
    def broken(staging: Any, storage_options: Any | None = None) -> Any:
        raise OSError(5, "Input/output error")

    io = AsyncCheckpointIO()
    monkeypatch.setattr(sharded_io, "storage_writer", broken)
    with pytest.raises((CheckpointWriteError, OSError), match="Input/output error"):
        io.save_sharded_checkpoint(_checkpoint(1.0), tmp_path / "a.ckpt", collectives=Collectives())
        io.wait()
    assert not (tmp_path / "a.ckpt").exists()
    io.teardown()


class RedirectingShardedIO(TorchCheckpointIO):
    """A user's IO that writes sharded checkpoints its own way (here: under another name, recorded)."""

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Any, **kwargs: Any) -> None:
        self.saved.append(str(path))
        super().save_sharded_checkpoint(checkpoint, f"{path}.redirected", **kwargs)


class StagingRecordingIO(TorchCheckpointIO):
    """A user's IO that customises only the directory methods (what AsyncCheckpointIO uses in the background)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_directory_checkpoint(self, path: Any, **kwargs: Any) -> str:
        self.started.append(str(path))
        return super().start_directory_checkpoint(path, **kwargs)


@pytest.mark.parametrize(
    ("inner", "synchronous"),
    [(TorchCheckpointIO, False), (MinimalIO, False), (StagingRecordingIO, False), (RedirectingShardedIO, True)],
)
def test_async_sharded_saves_run_an_overridden_save_sharded_checkpoint_itself_synchronously_and_say_so(
    tmp_path, inner, synchronous, slowed_writes, recwarn
):
    io, path = AsyncCheckpointIO(inner()), tmp_path / "a.ckpt"
    for value in (1.0, 2.0):  # the warning comes once per AsyncCheckpointIO
        io.save_sharded_checkpoint(_checkpoint(value), path, collectives=Collectives())
        if value == 1.0 and not synchronous:
            assert not path.exists()  # in the background: nothing published while the write is held back
            slowed_writes.set()
    io.wait()
    warnings = [str(w.message) for w in recwarn if "overrides save_sharded_checkpoint" in str(w.message)]
    assert len(warnings) == (1 if synchronous else 0)
    written = Path(f"{path}.redirected") if synchronous else path
    torch.testing.assert_close(io.load_checkpoint(written)["state_dict"], _checkpoint(2.0)["state_dict"])
    if synchronous:  # the user's own save ran, for both saves, and nothing was written where it did not write
        assert io.checkpoint_io.saved == [str(path)] * 2 and not path.exists()
        assert "RedirectingShardedIO" in warnings[0] and "start_directory_checkpoint" in warnings[0]
    if inner is StagingRecordingIO:
        assert io.checkpoint_io.started == [str(path)] * 2
    io.teardown()


# ---------------------------------------------------------------------------- staging buffers
@pytest.mark.parametrize("reuse", [True, False])
def test_staging_copies_every_tensor_of_nested_containers_and_reuses_buffers_only_when_asked(reuse):
    from collections import OrderedDict

    from phalanx.plugins.io.staging import StagingBuffers

    buffers = StagingBuffers(reuse=reuse)
    data = {"a": [torch.ones(3), (torch.zeros(2, 2), 5)], "b": OrderedDict(x=torch.arange(4)), "c": "text"}
    first = buffers.stage(data)
    assert type(first["b"]) is OrderedDict and first["c"] == "text" and first["a"][1][1] == 5
    torch.testing.assert_close(first["a"][0], torch.ones(3))
    assert first["a"][0].data_ptr() != data["a"][0].data_ptr()  # a copy, not the training tensor
    data["a"][0].add_(1)
    second = buffers.stage(data)
    torch.testing.assert_close(second["a"][0], torch.full((3,), 2.0))
    assert (second["a"][0].data_ptr() == first["a"][0].data_ptr()) is reuse
    data["a"][0] = torch.ones(5)  # another shape: a new buffer
    assert buffers.stage(data)["a"][0].shape == (5,)


class SlowIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        threading.Event().wait(0.3)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_later_one_file_save_waits_for_the_one_in_flight_so_staged_values_are_never_overwritten(tmp_path):
    io = AsyncCheckpointIO(SlowIO())
    checkpoint = _checkpoint(1.0)
    io.save_checkpoint(checkpoint, tmp_path / "one.ckpt")
    checkpoint["state_dict"]["w"].fill_(2.0)
    io.save_checkpoint(checkpoint, tmp_path / "two.ckpt")  # reuses the staging buffers: waits for 'one' first
    io.teardown()
    assert TorchCheckpointIO().load_checkpoint(tmp_path / "one.ckpt")["state_dict"]["w"].eq(1.0).all()
    assert TorchCheckpointIO().load_checkpoint(tmp_path / "two.ckpt")["state_dict"]["w"].eq(2.0).all()
