"""xla_fsdp's sharded checkpoint directories, without torch_xla: written by replica threads the way the strategy writes
them (pieces cut as torch_xla's wrapper cuts them), then read back whole, per replica, through a CheckpointIO, by the
CLI, and attacked (tampered layouts, hostile pickles, damaged files, a replica whose write fails).
"""

from __future__ import annotations

import math
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from checkpoint_attacks import (
    DAMAGE_KINDS,
    SENTINEL,
    CliError,
    consolidate_through_cli,
    damage,
    payloads,
    splice,
    torch_file,
)

from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.formats.xla_fsdp import (
    META_FILE,
    ShardState,
    consolidate_xla_fsdp,
    read_own_pieces,
    shard_file,
    write_sharded,
)
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")

# name -> whole shape; a 1-element bias and a 0-dim scale test the padding at its extremes
SHAPES = {"net.0.weight": [5, 3], "net.0.bias": [5], "net.2.weight": [1, 5], "net.2.bias": [1], "scale": []}


def whole_state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    moments = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    return {"params": params, "moments": moments, "buffer": torch.arange(3.0)}


def cut(whole: torch.Tensor, rank: int, world: int, multiple: int, dim0: bool) -> torch.Tensor:
    """Replica ``rank``'s piece as torch_xla's wrapper makes it (flat, or rows with ``shard_param_on_dim_0``)."""
    if dim0 and whole.dim() > 0:
        rows = math.ceil(whole.shape[0] / world)
        padded = torch.zeros(rows * world, *whole.shape[1:])
        padded[: whole.shape[0]] = whole
        return padded[rank * rows : (rank + 1) * rows].clone()
    flat = whole.reshape(-1)
    size = math.ceil(flat.numel() / (world * multiple)) * world * multiple
    padded = torch.zeros(size)
    padded[: flat.numel()] = flat
    piece = size // world
    return padded[rank * piece : (rank + 1) * piece].clone()


class ThreadGroup:
    """Collectives for replicas that are threads of this process (as torch_xla's CPU replicas are)."""

    def __init__(self, world: int) -> None:
        self.world, self.gate, self.slot = world, threading.Barrier(world, timeout=30), {}

    def collectives(self, rank: int) -> Collectives:
        def broadcast(obj: Any, src: int = 0) -> Any:
            if rank == src:
                self.slot["value"] = obj
            self.gate.wait()
            value = self.slot["value"]
            self.gate.wait()
            return value

        return Collectives(
            rank=rank, world_size=self.world, broadcast=broadcast, barrier=lambda name=None: self.gate.wait()
        )

    def all_succeeded(self, rank: int) -> Callable[[bool], bool]:
        def agree(ok: bool) -> bool:
            self.slot[("ok", rank)] = ok
            self.gate.wait()
            result = all(self.slot[("ok", r)] for r in range(self.world))
            self.gate.wait()
            return result

        return agree


def replica_checkpoint(state: dict[str, Any], rank: int, world: int, multiple: int, dim0: bool) -> dict[str, Any]:
    pieces = {name: cut(value, rank, world, multiple, dim0) for name, value in state["params"].items()}
    names = list(SHAPES)
    adam = {
        index: {"step": torch.tensor(3.0), "exp_avg": cut(state["moments"][name], rank, world, multiple, dim0)}
        for index, name in enumerate(names)
    }
    return {
        "state_dict": {**pieces, "norm.running_mean": state["buffer"]},
        "optimizer_states": [{"state": adam, "param_groups": [{"lr": 0.01, "params": list(range(len(names)))}]}],
        "global_step": 3,
        "epoch": 0,
    }


def layout(world: int, multiple: int, dim0: bool) -> dict[str, Any]:
    probe = whole_state()
    parameters = {
        name: {"shape": shape, "piece": list(cut(probe["params"][name], 0, world, multiple, dim0).shape)}
        for name, shape in SHAPES.items()
    }
    return {"format": 1, "world_size": world, "parameters": parameters, "optimizer_parameters": [list(SHAPES)]}


def write(
    path: Path,
    world: int,
    *,
    multiple: int = 1,
    dim0: bool = False,
    seed: int = 0,
    io: Any = None,
    fail: int = -1,
    weights_only: bool = False,
    make_io: Callable[[int], Any] | None = None,
) -> list[BaseException | None]:
    """Every replica (a thread) saves its checkpoint to ``path``; returns what each raised."""
    group, state, errors = ThreadGroup(world), whole_state(seed), [None] * world

    def replica(rank: int) -> None:
        writer = io or TorchCheckpointIO()
        if make_io is not None:
            writer = make_io(rank)
        elif rank == fail:
            writer = FailingIO()
        checkpoint = replica_checkpoint(state, rank, world, multiple, dim0)
        if weights_only:  # Trainer.save_checkpoint(..., weights_only=True): no optimizer states
            checkpoint.pop("optimizer_states")
        try:
            write_sharded(
                writer,
                checkpoint,
                path,
                layout=layout(world, multiple, dim0),
                collectives=group.collectives(rank),
                all_succeeded=group.all_succeeded(rank),
            )
        except BaseException as error:  # noqa: BLE001 - returned to the test
            errors[rank] = error

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a replica hung"
    return errors


class FailingIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        raise OSError(28, "No space left on device")


class RecordingIO(TorchCheckpointIO):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.calls.append(("save", Path(path).name))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
        self.calls.append(("load", Path(path).name))
        return super().load_checkpoint(path, map_location)


def assert_whole(checkpoint: dict[str, Any], seed: int = 0) -> None:
    state = whole_state(seed)
    for name, value in state["params"].items():
        torch.testing.assert_close(checkpoint["state_dict"][name], value, rtol=0, atol=0)
    torch.testing.assert_close(checkpoint["state_dict"]["norm.running_mean"], state["buffer"], rtol=0, atol=0)
    adam = checkpoint["optimizer_states"][0]["state"]
    for index, name in enumerate(SHAPES):
        torch.testing.assert_close(adam[index]["exp_avg"], state["moments"][name], rtol=0, atol=0)
        assert adam[index]["step"].item() == 3.0
    assert checkpoint["global_step"] == 3 and "xla_fsdp_shards" not in checkpoint


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    ("world", "multiple", "dim0"),
    [(1, 1, False), (2, 1, False), (3, 1, False), (2, 128, False), (3, 128, False), (2, 1, True), (3, 1, True)],
    ids=["1", "2", "3", "2 aligned to 128", "3 aligned to 128", "2 by rows", "3 by rows"],
)
def test_pieces_written_by_each_replica_read_back_whole_and_per_replica(tmp_path, world, multiple, dim0):
    path = tmp_path / "last.ckpt"
    assert write(path, world, multiple=multiple, dim0=dim0) == [None] * world
    assert checkpoint_layout(path) == "xla_fsdp"
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([".complete", META_FILE, *(shard_file(r, world) for r in range(world))])
    assert_whole(consolidate_xla_fsdp(path))
    assert_whole(TorchCheckpointIO().load_checkpoint(path))  # what any other strategy reads
    state = whole_state()
    for rank in range(world):
        own = read_own_pieces(path, rank=rank, world_size=world, read=TorchCheckpointIO().load_checkpoint)
        assert isinstance(own["state_dict"], ShardState) and isinstance(own["optimizer_states"][0], ShardState)
        for name, value in state["params"].items():
            torch.testing.assert_close(own["state_dict"][name], cut(value, rank, world, multiple, dim0))
    other = world + 1
    assert read_own_pieces(path, rank=0, world_size=other, read=TorchCheckpointIO().load_checkpoint) is None


def test_a_weights_only_save_reads_back_without_optimizer_states(tmp_path):
    path = tmp_path / "weights.ckpt"
    assert write(path, 2, weights_only=True) == [None, None]
    whole = consolidate_xla_fsdp(path)
    assert "optimizer_states" not in whole
    torch.testing.assert_close(whole["state_dict"]["net.0.weight"], whole_state()["params"]["net.0.weight"])
    own = read_own_pieces(path, rank=1, world_size=2, read=TorchCheckpointIO().load_checkpoint)
    assert "optimizer_states" not in own and set(own["state_dict"]) == {*SHAPES, "norm.running_mean"}


def test_every_file_is_written_and_read_through_the_checkpoint_io(tmp_path):
    path, io = tmp_path / "last.ckpt", RecordingIO()
    assert write(path, 2, io=io) == [None, None]
    assert sorted(io.calls) == sorted([("save", shard_file(0, 2)), ("save", shard_file(1, 2)), ("save", META_FILE)])
    io.calls.clear()
    consolidate_xla_fsdp(path, read=io.load_checkpoint)
    assert sorted(io.calls) == sorted([("load", META_FILE), ("load", shard_file(0, 2)), ("load", shard_file(1, 2))])
    io.calls.clear()
    read_own_pieces(path, rank=1, world_size=2, read=io.load_checkpoint)
    assert io.calls == [("load", META_FILE), ("load", shard_file(1, 2))]  # a replica reads only its own pieces


def test_a_replica_whose_write_fails_fails_the_save_everywhere_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    assert write(path, 2, seed=0) == [None, None]
    errors = write(path, 2, seed=1, fail=1)
    assert all(isinstance(error, CheckpointWriteError) for error in errors), errors
    assert "No space left on device" in str(errors[1]) and "another replica" in str(errors[0])
    assert_whole(consolidate_xla_fsdp(path), seed=0)  # the previous checkpoint, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no staging directory left behind


def test_a_remote_directory_is_written_and_read_through_fsspec():
    path = "memory://xla_fsdp_checkpoint_test/last.ckpt"
    assert write(path, 2, multiple=128) == [None, None]
    assert checkpoint_layout(path) == "xla_fsdp"
    assert_whole(consolidate_xla_fsdp(path))
    assert_whole(TorchCheckpointIO().load_checkpoint(path))
    own = read_own_pieces(path, rank=1, world_size=2, read=TorchCheckpointIO().load_checkpoint)
    assert own["state_dict"]["net.0.weight"].shape == (128,)


@pytest.mark.parametrize("fail", [-1, 1], ids=["every write succeeds", "replica 1's disk is full"])
def test_async_io_writes_the_directory_now_where_replicas_share_no_process_group(tmp_path, fail):
    """Replica threads have no torch.distributed group for AsyncCheckpointIO's background publish: it writes and
    publishes the directory before the save returns (a background publish could not wait for the other replicas)."""
    from phalanx.plugins.io.async_io import AsyncCheckpointIO

    path = tmp_path / "last.ckpt"
    assert write(path, 2, seed=0) == [None, None]
    ios: list[AsyncCheckpointIO] = []

    def make_io(rank: int) -> AsyncCheckpointIO:
        ios.append(AsyncCheckpointIO(FailingIO() if rank == fail else TorchCheckpointIO()))
        return ios[-1]

    with pytest.warns(UserWarning, match="writes directory checkpoints synchronously here"):
        errors = write(path, 2, seed=1, make_io=make_io)
    if fail < 0:
        assert errors == [None, None]
        assert_whole(consolidate_xla_fsdp(path), seed=1)  # published before the save returned
    else:
        assert all(isinstance(error, CheckpointWriteError) for error in errors), errors
        assert_whole(consolidate_xla_fsdp(path), seed=0)  # the previous checkpoint, untouched
    assert all(not io._pending for io in ios)  # nothing left in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_unfinished_directory_is_refused(tmp_path):
    path = tmp_path / "last.ckpt"
    write(path, 2)
    (path / ".complete").unlink()
    for read in (consolidate_xla_fsdp, TorchCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointError, match="incomplete xla_fsdp checkpoint"):
            read(path)


def test_the_cli_consolidates_into_one_weights_only_file(tmp_path):
    path = tmp_path / "last.ckpt"
    write(path, 3, multiple=128)
    consolidate_through_cli(path, tmp_path)
    assert_whole(torch.load(tmp_path / "consolidated.ckpt", weights_only=True))


# ---------------------------------------------------------------------------- attacks
def _tamper_layout(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = torch.load(path / META_FILE, weights_only=True)
    change(meta["xla_fsdp_shards"])
    torch.save(meta, path / META_FILE)


def _tamper_pieces(path: Path, rank: int, change: Callable[[dict[str, Any]], None]) -> None:
    pieces = torch.load(path / shard_file(rank, 2), weights_only=True)
    change(pieces)
    torch.save(pieces, path / shard_file(rank, 2))


TAMPERED = [
    ("world size as text", lambda p: _tamper_layout(p, lambda lay: lay.update(world_size="2")), "world_size '2'"),
    ("world size 0", lambda p: _tamper_layout(p, lambda lay: lay.update(world_size=0)), "world_size 0"),
    ("world size True", lambda p: _tamper_layout(p, lambda lay: lay.update(world_size=True)), "world_size True"),
    ("huge world size", lambda p: _tamper_layout(p, lambda lay: lay.update(world_size=10**9)), "world_size 1000000000"),
    ("another format", lambda p: _tamper_layout(p, lambda lay: lay.update(format=2)), "format 2"),
    (
        "negative dimension",
        lambda p: _tamper_layout(p, lambda lay: lay["parameters"]["net.0.bias"].update(shape=[-5])),
        "'parameters' must map",
    ),
    (
        "pieces smaller than the parameter",
        lambda p: _tamper_layout(p, lambda lay: lay["parameters"]["net.0.weight"].update(shape=[500, 3])),
        "at least as large",
    ),
    (
        "an optimizer index naming no parameter",
        lambda p: _tamper_layout(p, lambda lay: lay.update(optimizer_parameters=[["../../etc/passwd"]])),
        "'optimizer_parameters'",
    ),
    ("layout missing", lambda p: _tamper_layout(p, lambda lay: lay.clear()), "format None"),
    (
        "a piece of the wrong shape",
        lambda p: _tamper_pieces(p, 1, lambda pc: pc["state_dict"].update({"net.0.weight": torch.zeros(99)})),
        "shards-00001-of-00002.pt should hold a piece of shape",
    ),
    (
        "a piece of a parameter the layout does not list",
        lambda p: _tamper_pieces(p, 1, lambda pc: pc["state_dict"].update({"extra": torch.zeros(1)})),
        "does not list: \\['extra'\\]",
    ),
    (
        "a piece missing",
        lambda p: _tamper_pieces(p, 0, lambda pc: pc["state_dict"].pop("net.2.bias")),
        "should hold a piece of shape \\[1\\] of 'net.2.bias'",
    ),
    (
        "the replicas disagree on an optimizer state",
        lambda p: _tamper_pieces(p, 1, lambda pc: pc["optimizer_states"][0]["state"][0].pop("exp_avg")),
        "disagree on the optimizer state 'exp_avg'",
    ),
    ("no state_dict", lambda p: _tamper_pieces(p, 1, lambda pc: pc.pop("state_dict")), "holds no 'state_dict'"),
    (
        "a second optimizer in one replica",
        lambda p: _tamper_pieces(p, 1, lambda pc: pc["optimizer_states"].append({"state": {}})),
        "holds 2 optimizer state",
    ),
]


@pytest.mark.parametrize(("change", "message"), [row[1:] for row in TAMPERED], ids=[row[0] for row in TAMPERED])
def test_a_tampered_directory_is_refused_naming_what_is_wrong(tmp_path, change, message):
    path = tmp_path / "last.ckpt"
    write(path, 2)
    change(path)
    with pytest.raises(CheckpointError, match=message):
        consolidate_xla_fsdp(path)
    with pytest.raises(CliError, match=message):
        consolidate_through_cli(path, tmp_path)


# Each reader reads the file under attack: a replica reads the meta file and its own pieces only.
READERS = {
    "consolidate": lambda path, rank: consolidate_xla_fsdp(path),
    "a replica's own pieces": lambda path, rank: read_own_pieces(
        path, rank=rank, world_size=2, read=TorchCheckpointIO().load_checkpoint
    ),
    "load_checkpoint of the directory": lambda path, rank: TorchCheckpointIO().load_checkpoint(path),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("file", [META_FILE, shard_file(1, 2)])
@pytest.mark.parametrize("payload", list(payloads(Path("marker"))))
def test_hostile_files_are_refused_by_every_reader_and_run_nothing(tmp_path, payload, file, reader):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker, legacy=True)[payload]
    path = tmp_path / "last.ckpt"
    write(path, 2)
    (path / file).write_bytes(torch_file(splice({"hostile": SENTINEL}, ops, legacy=True)))
    with pytest.raises(UnsafeCheckpointError) as refused:
        READERS[reader](path, 1)
    assert str(path / file) in str(refused.value) and offending in str(refused.value), refused.value
    assert not marker.exists()


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
@pytest.mark.parametrize("file", [META_FILE, shard_file(0, 2)])
def test_a_damaged_file_gives_a_checkpoint_error_naming_it(tmp_path, file, kind):
    path = tmp_path / "last.ckpt"
    write(path, 2)
    damage(path / file, kind)
    for read in READERS.values():
        with pytest.raises((CheckpointError, FileNotFoundError)) as refused:
            read(path, 0)
        assert file in str(refused.value), refused.value


def test_a_copied_directory_reads_the_same(tmp_path):
    path = tmp_path / "last.ckpt"
    write(path, 2)
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(path, copy)
    assert_whole(consolidate_xla_fsdp(copy))
