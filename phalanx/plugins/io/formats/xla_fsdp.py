"""xla_fsdp's sharded checkpoints: a directory with each replica's pieces, and the whole checkpoint made from them.

Layout of ``NAME.ckpt/``::

    phalanx_xla_fsdp.pt            rank 0: everything but the parameters' pieces (trainer state, buffers, the layout)
    shards-00000-of-00002.pt       replica 0: its piece of every parameter and of its optimizer state tensors
    shards-00001-of-00002.pt       replica 1: likewise
    .complete                      written last, once every replica finished

Every file is an ordinary phalanx checkpoint file (tensors, numbers, strings, lists, dicts: ``weights_only``-safe).
A piece is what torch_xla's wrapper holds: the parameter flattened (or, with ``shard_param_on_dim_0``, kept in its
rows), padded with zeros to the wrapper's alignment and cut in equal parts. The layout records each piece's shape:
the pieces put end to end in replica order and cut to the parameter's size give it back whole. The same number of
replicas reads its own pieces back; any other strategy or world size reads the whole checkpoint
(``consolidate_xla_fsdp``), which is also what ``phalanx checkpoint consolidate`` writes.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from torch import Tensor

from phalanx.plugins.io.bounded_reads import (
    allocation_budget,
    check_tensors,
    counted_cat,
    counted_clone,
    is_regular_file,
    open_checkpoint_file,
)
from phalanx.plugins.io.checkpoint_files import path_inside
from phalanx.plugins.io.directory import require_complete
from phalanx.plugins.io.serialization import discard, is_url, load_file
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError

META_FILE = "phalanx_xla_fsdp.pt"
LAYOUT_KEY = "xla_fsdp_shards"
FORMAT_VERSION = 1
_MAX_REPLICAS = 1 << 16  # far beyond any pod; bounds the files a tampered layout can make a reader look for

Reader = Callable[[str], dict[str, Any]]


class ShardState(dict):
    """A state that holds this replica's pieces (not whole tensors): what a sharded checkpoint gives back."""


def shard_file(rank: int, world_size: int) -> str:
    """The name of replica ``rank``'s file in a checkpoint written by ``world_size`` replicas."""
    return f"shards-{rank:05d}-of-{world_size:05d}.pt"


def join(directory: Any, name: str) -> str:
    """``name`` inside ``directory`` (a local path or an fsspec URL)."""

    if is_url(directory):
        return f"{str(directory).rstrip('/')}/{name}"
    return os.path.join(os.fspath(directory), name)


# ---------------------------------------------------------------------------- writing
def split_for_save(
    checkpoint: dict[str, Any], layout: dict[str, Any], parameter_names: set[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rank 0's meta, this replica's pieces) of a checkpoint whose parameters and optimizer states are pieces."""
    state = checkpoint.get("state_dict", {})
    pieces: dict[str, Any] = {"state_dict": {name: value for name, value in state.items() if name in parameter_names}}
    if "optimizer_states" in checkpoint:  # a weights-only save has none
        pieces["optimizer_states"] = list(checkpoint["optimizer_states"])
    meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    meta["state_dict"] = {name: value for name, value in state.items() if name not in parameter_names}  # buffers
    meta[LAYOUT_KEY] = layout
    return meta, pieces


def write_sharded(
    io: Any,
    checkpoint: dict[str, Any],
    path: Any,
    *,
    layout: dict[str, Any],
    collectives: Any,
    all_succeeded: Callable[[bool], bool],
    storage_options: Any = None,
) -> None:
    """Every replica writes its pieces into a staging directory; rank 0 adds the rest and publishes ``path``.

    ``all_succeeded(ok)`` tells every replica whether all wrote their files: a failed write on one replica then fails
    the save on every replica (nothing is published, the previous checkpoint stays) instead of leaving the others
    waiting for it.
    """

    meta, pieces = split_for_save(checkpoint, layout, set(layout["parameters"]))
    staging = io.start_directory_checkpoint(path, collectives=collectives)
    error: BaseException | None = None
    try:
        name = shard_file(collectives.rank, collectives.world_size)
        io.save_checkpoint(pieces, join(staging, name), storage_options=storage_options)
        if collectives.is_global_zero:
            io.save_checkpoint(meta, join(staging, META_FILE), storage_options=storage_options)
    except Exception as caught:  # reported to every replica below, then raised
        error = caught
    if not all_succeeded(error is None):
        if collectives.is_global_zero:
            discard(staging)
        reason = f"{type(error).__name__}: {error}" if error is not None else "another replica's write failed"
        raise CheckpointWriteError(
            f"The sharded save of {path} failed ({reason}). Nothing was published: the previous checkpoint at {path},"
            " if there is one, is unchanged."
        ) from error
    io.finish_directory_checkpoint(staging, path, collectives=collectives)


# ---------------------------------------------------------------------------- reading
def _file(path: Any, name: str) -> str:
    """``name`` inside the checkpoint ``path``; a local one must be a regular file that stays inside ``path``."""

    file = join(path, name)
    if not is_url(path):
        path_inside(file, root=path, what=f"the xla_fsdp file {name}")
        if os.path.lexists(file) and not is_regular_file(file):
            open_checkpoint_file(file).close()  # refuses it, naming what it is
    return file


def read_layout(path: Any, read: Reader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, its checked layout) of the sharded xla_fsdp checkpoint at ``path``."""
    meta = read(_file(path, META_FILE))
    layout = meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None
    if not isinstance(layout, dict):
        raise CheckpointError(f"{path}: {META_FILE} has no {LAYOUT_KEY!r} entry; it is not an xla_fsdp checkpoint.")
    _check_layout(path, layout)
    return meta, layout


def _check_layout(path: Any, layout: dict[str, Any]) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: the layout in {META_FILE} is damaged: {what}.")

    if layout.get("format") != FORMAT_VERSION:
        raise bad(f"format {layout.get('format')!r}, this phalanx reads format {FORMAT_VERSION}")
    world_size = layout.get("world_size")
    if type(world_size) is not int or not 1 <= world_size <= _MAX_REPLICAS:
        raise bad(f"world_size {world_size!r} is not an int in [1, {_MAX_REPLICAS}]")
    parameters = layout.get("parameters")
    if not isinstance(parameters, dict) or not all(
        isinstance(name, str) and _fits(entry, world_size) for name, entry in parameters.items()
    ):
        raise bad(
            "'parameters' must map each parameter name to its 'shape' and its 'piece' shape (lists of non-negative"
            " ints; the pieces of all replicas at least as large as the parameter)"
        )
    owners = layout.get("optimizer_parameters")
    if not isinstance(owners, list) or not all(
        isinstance(names, list) and all(name is None or name in parameters for name in names) for names in owners
    ):
        raise bad("'optimizer_parameters' must list, per optimizer, the parameter name (or None) of each index")


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 64 and all(type(d) is int and 0 <= d < 1 << 40 for d in value)


def _fits(entry: Any, world_size: int) -> bool:
    if not isinstance(entry, dict) or not _is_shape(entry.get("shape")) or not _is_shape(entry.get("piece")):
        return False
    return math.prod(entry["piece"]) * world_size >= math.prod(entry["shape"])


def read_own_pieces(path: Any, *, rank: int, world_size: int, read: Reader) -> dict[str, Any] | None:
    """The checkpoint with this replica's pieces (as ``ShardState``), or None when another world size wrote it."""
    meta, layout = read_layout(path, read)
    if layout["world_size"] != world_size:
        return None
    pieces = _read_pieces(path, rank, layout, read)
    checkpoint = {key: value for key, value in meta.items() if key != LAYOUT_KEY}
    checkpoint["state_dict"] = ShardState({**meta.get("state_dict", {}), **pieces["state_dict"]})
    if "optimizer_states" in pieces:
        checkpoint["optimizer_states"] = [ShardState(state) for state in pieces["optimizer_states"]]
    return checkpoint


def _read_pieces(path: Any, rank: int, layout: dict[str, Any], read: Reader) -> dict[str, Any]:
    world_size = layout["world_size"]
    name = shard_file(rank, world_size)
    pieces = read(_file(path, name))
    state = pieces.get("state_dict") if isinstance(pieces, dict) else None
    optimizers = pieces.get("optimizer_states", []) if isinstance(pieces, dict) else None
    if not isinstance(state, dict) or not isinstance(optimizers, list):
        raise CheckpointError(f"{path}: {name} holds no 'state_dict' (or a damaged 'optimizer_states'); it is damaged.")
    for parameter, entry in layout["parameters"].items():
        value = state.get(parameter)
        if not isinstance(value, Tensor) or list(value.shape) != entry["piece"]:
            found = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise CheckpointError(
                f"{path}: {name} should hold a piece of shape {entry['piece']} of {parameter!r} (shape"
                f" {entry['shape']} over {world_size} replicas), found {found}."
            )
    unexpected = sorted(set(state) - set(layout["parameters"]))
    if unexpected:
        raise CheckpointError(f"{path}: {name} holds pieces of parameters its layout does not list: {unexpected}.")
    if "optimizer_states" in pieces and len(optimizers) != len(layout["optimizer_parameters"]):
        raise CheckpointError(
            f"{path}: {name} holds {len(optimizers)} optimizer state(s), the layout lists"
            f" {len(layout['optimizer_parameters'])}."
        )
    return pieces


def consolidate_xla_fsdp(path: Any, read: Reader | None = None) -> dict[str, Any]:
    """The whole checkpoint (whole tensors under the module's names) of the sharded xla_fsdp checkpoint at ``path``."""
    require_complete(path, "xla_fsdp", (META_FILE,))  # a directory whose save did not finish is never read
    read = read or _read_local
    meta, layout = read_layout(path, read)
    world_size, parameters = layout["world_size"], layout["parameters"]
    every = [_read_pieces(path, rank, layout, read) for rank in range(world_size)]
    check_tensors([meta, every], str(path))  # whichever CheckpointIO read them
    state = dict(meta.get("state_dict", {}))
    with allocation_budget([meta, every], str(path)):  # what the pieces claim, bounded by the bytes they hold
        for name, entry in parameters.items():
            state[name] = _whole([pieces["state_dict"][name] for pieces in every], entry["shape"])
        checkpoint = {key: value for key, value in meta.items() if key != LAYOUT_KEY}
        checkpoint["state_dict"] = state
        if "optimizer_states" in every[0]:
            checkpoint["optimizer_states"] = [
                _whole_optimizer_state(path, [pieces["optimizer_states"][index] for pieces in every], owners, layout)
                for index, owners in enumerate(layout["optimizer_parameters"])
            ]
    return checkpoint


def _whole(pieces: list[Tensor], shape: list[int]) -> Tensor:
    return counted_clone(counted_cat(pieces)[: math.prod(shape)].reshape(shape))


def _whole_optimizer_state(
    path: Any, per_rank: list[Any], owners: list[str | None], layout: dict[str, Any]
) -> dict[str, Any]:
    parameters = layout["parameters"]
    first = per_rank[0]
    if not all(isinstance(state, dict) and isinstance(state.get("state"), dict) for state in per_rank):
        raise CheckpointError(f"{path}: an optimizer state in the replicas' files holds no 'state' dict.")
    whole: dict[Any, dict[str, Any]] = {}
    for index, entries in first["state"].items():
        owner = owners[index] if type(index) is int and 0 <= index < len(owners) else None
        entry = parameters.get(owner) if owner is not None else None
        whole[index] = {}
        for key, value in entries.items():
            if entry is not None and isinstance(value, Tensor) and list(value.shape) == entry["piece"]:
                pieces = [state["state"].get(index, {}).get(key) for state in per_rank]
                if not all(isinstance(piece, Tensor) and list(piece.shape) == entry["piece"] for piece in pieces):
                    raise CheckpointError(
                        f"{path}: the replicas' files disagree on the optimizer state {key!r} of {owner!r}."
                    )
                whole[index][key] = _whole(pieces, entry["shape"])
            else:
                whole[index][key] = value  # a step count, or a state of a parameter that is not sharded
    return {"state": whole, "param_groups": first.get("param_groups", [])}


def _read_local(path: str) -> dict[str, Any]:
    return load_file(path)


def is_xla_fsdp_checkpoint(directory: Any) -> bool:
    """Whether the local ``directory`` holds a sharded xla_fsdp checkpoint's meta file (whatever it is: reading it
    refuses anything but a regular file inside the directory, naming what it is)."""
    return os.path.lexists(os.path.join(os.fspath(directory), META_FILE))


__all__ = ["META_FILE", "ShardState", "consolidate_xla_fsdp", "read_own_pieces", "shard_file", "write_sharded"]
