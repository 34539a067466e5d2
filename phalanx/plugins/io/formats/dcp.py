"""Sharded checkpoint directories: tensors through torch.distributed.checkpoint (DCP), the rest in one plain file.

Layout of ``NAME.ckpt/``::

    .metadata, __<rank>_0.distcp   DCP: every rank writes its own shards of the module and optimizer tensors
    phalanx_meta.pt                  everything else of the checkpoint (loops, callbacks, RNG states, optimizer
                                     hyper-parameters...), plain values, loadable with weights_only=True
    .complete                        written last, once every rank has finished: only then is the checkpoint used

Only tensors go through DCP, so reading never needs DCP's pickled byte entries (DCP would unpickle those with
``weights_only=False``): a read that asks for one is refused. DCP's own ``.metadata`` file is read with an unpickler
that accepts only the globals DCP writes there, and checked against the directory before DCP uses it (see
``formats.dcp_metadata``); ``phalanx_meta.pt`` is read with ``weights_only=True``. Whatever is wrong with a
directory (a file missing, truncated or from another checkpoint, a hostile pickle, a name leading outside it) gives
one ``CheckpointError`` naming the file and the entry, never torch's ``CheckpointException`` (a ``BaseException``).

A save goes to a hidden temporary directory that is renamed into place when complete, so a crash or a failed write
(disk full) mid-save leaves the previous checkpoint of that name intact; a failed write raises ``CheckpointWriteError``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from phalanx.plugins.io.bounded_reads import open_checkpoint_file
from phalanx.plugins.io.checkpoint_files import entry_inside
from phalanx.plugins.io.directory import publish_directory, staging_directory
from phalanx.plugins.io.formats.dcp_metadata import DCP_METADATA_FILE, read_metadata
from phalanx.plugins.io.serialization import load_bytes, save_into
from phalanx.plugins.io.write_failures import causes as _causes
from phalanx.plugins.io.write_failures import describe as _describe
from phalanx.plugins.io.write_failures import free_space, raise_recorded, watch_writes
from phalanx.plugins.io.write_failures import root_cause as _root_cause
from phalanx.utilities.dtensor import is_dtensor
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError, UnsafeCheckpointError

META_FILE = "phalanx_meta.pt"
#: In phalanx_meta.pt: the id DCP gave the save, to recognise a ``.metadata`` of another checkpoint.
_SAVE_ID = "dcp_save_id"
_MODEL_PREFIX = "model/"
_OPTIMIZER_PREFIX = "optimizer/"
#: In an optimizer state keyed by parameter name: the (parameter, entry) tensors that other ranks hold and write.
ELSEWHERE = "tensors_on_other_ranks"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint directory written by phalanx."""
    directory = Path(path)
    return directory.is_dir() and (directory / DCP_METADATA_FILE).exists() and (directory / META_FILE).exists()


# ---------------------------------------------------------------------------- splitting a checkpoint
def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Separate the module and sharded optimizer tensors (for DCP) from the plain rest (for the meta file)."""
    tensors = {_MODEL_PREFIX + name: value for name, value in checkpoint.get("state_dict", {}).items()}
    meta = {key: value for key, value in checkpoint.items() if key != "state_dict"}
    moved: list[list[Any]] = []
    if "optimizer_states" in checkpoint:
        optimizer_states = []
        for index, state in enumerate(checkpoint["optimizer_states"]):
            # A state keyed by name (a pipeline's) sends every tensor through DCP: each rank writes its own stages'.
            # The tensors other ranks write are listed (by rank 0, which writes this file) under ELSEWHERE.
            state = dict(state)
            moved.extend([index, pid, name] for pid, name in state.pop(ELSEWHERE, []))
            per_parameter = {}
            for pid, entries in state["state"].items():
                kept = {}
                for name, value in entries.items():
                    if is_dtensor(value) or (isinstance(pid, str) and isinstance(value, Tensor)):
                        tensors[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"] = value
                        moved.append([index, pid, name])
                    else:
                        kept[name] = value
                per_parameter[pid] = kept
            optimizer_states.append({**state, "state": per_parameter})
        meta["optimizer_states"] = optimizer_states
    meta["sharded_tensors"] = {"model": sorted(checkpoint.get("state_dict", {})), "optimizer": moved}
    return tensors, meta


# ---------------------------------------------------------------------------- writing
def write_meta(staging: Any, meta: dict[str, Any], metadata: Any) -> None:
    """Write the plain part of a sharded checkpoint into ``staging`` (local or URL; rank 0), with the id DCP gave the
    save, streamed into its file."""
    meta[_SAVE_ID] = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    save_into(meta, f"{str(staging).rstrip('/')}/{META_FILE}")


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    is_global_zero: bool,
    broadcast: Callable[[Any], Any],
    barrier: Callable[[str], None],
) -> None:
    """Write ``checkpoint`` as a sharded directory at ``path`` (every rank calls this; rank 0 finishes it).

    Raises ``CheckpointWriteError`` (naming the directory and the cause) when the files cannot be written; the
    previous checkpoint at ``path`` is then left as it was.
    """
    import torch.distributed.checkpoint as dcp

    target = Path(path)
    staging = staging_directory(target, is_global_zero=is_global_zero, broadcast=broadcast)
    tensors, meta = split_checkpoint(checkpoint)
    recorded: list[OSError] = []
    try:
        try:
            writer = dcp.FileSystemWriter(staging)
            recorded = watch_writes(writer)  # torch's zip writer hides a write's OSError behind its own error
            metadata = dcp.save(tensors, storage_writer=writer)
            raise_recorded(recorded)
            if is_global_zero:
                write_meta(staging, meta, metadata)
        except CheckpointError:
            raise
        except BaseException as error:
            _reraise_interrupt(error)
            raise CheckpointWriteError(_write_failure(target, error, recorded)) from _root_cause(error, recorded)
        barrier("sharded checkpoint written")
        if is_global_zero:
            publish_directory(staging, target)
    except BaseException:
        if is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _reraise_interrupt(error: BaseException) -> None:
    """Raise the KeyboardInterrupt or SystemExit in ``error`` (DCP wraps them too): they are no failed read or write."""
    from torch.distributed.checkpoint.api import CheckpointException

    interrupt = next((e for e in _causes(error) if not isinstance(e, (Exception, CheckpointException))), None)
    if interrupt is not None:
        raise interrupt


def _write_failure(target: Path, error: BaseException, recorded: list[OSError] | None = None) -> str:
    return (
        f"Could not write the sharded checkpoint {target}: {_describe(_root_cause(error, recorded))}"
        f"{free_space(target.parent)}. Nothing was published: the previous checkpoint at {target}, if there is one,"
        " is unchanged."
    )


# ---------------------------------------------------------------------------- reading
@functools.cache
def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class SafeFileSystemReader(FileSystemReader):
        """DCP's reader, given metadata phalanx has checked; it reads tensors only, one entry at a time."""

        def __init__(self, directory: Path, metadata: Any) -> None:
            super().__init__(directory)
            self._directory = directory
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if self._metadata.storage_meta is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                if item.type != LoadItemType.TENSOR:
                    raise UnsafeCheckpointError(
                        f"Refusing to read {self._directory}: entry {item.dest_index.fqn!r} is stored as pickled"
                        " bytes, which DCP"
                        " unpickles with weights_only=False (running code chosen by the file's author); phalanx"
                        " checkpoints hold only tensors there."
                    )
            for item in plan.items:
                # One entry per call, so that a failure names its file and entry.
                info = self.storage_data[item.storage_index]
                entry_inside(
                    self._directory,
                    info.relative_path,
                    root=self._directory,
                    what=f"the shard file of entry {item.dest_index.fqn!r}",
                )
                try:
                    super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
                except Exception as error:
                    raise CheckpointError(
                        f"{self._directory / info.relative_path} is damaged or belongs to another checkpoint: entry"
                        f" {item.dest_index.fqn!r} (bytes {info.offset}..{info.offset + info.length}) cannot be read:"
                        f" {_describe(error)}"
                    ) from None
            done: Future = Future()
            done.set_result(None)
            return done

    return SafeFileSystemReader


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The plain part of a sharded checkpoint (without its tensors)."""

    directory = Path(path)
    if not is_sharded_checkpoint(directory):
        missing = (
            [name for name in (DCP_METADATA_FILE, META_FILE) if not (directory / name).exists()]
            if directory.is_dir()
            else []
        )
        detail = (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
            if missing
            else "it is not a directory"
        )
        raise CheckpointError(f"{directory} is not a sharded phalanx checkpoint: {detail}.")
    file = entry_inside(directory, META_FILE, root=directory, what="phalanx's state file")
    with open_checkpoint_file(file, str(directory / META_FILE)) as handle:
        meta = load_bytes(handle, str(directory / META_FILE))
    _check_meta(meta, directory / META_FILE)
    return meta


def _check_meta(meta: dict[str, Any], source: Path) -> None:
    sharded = meta.get("sharded_tensors")
    model = sharded.get("model") if isinstance(sharded, dict) else None
    optimizer = sharded.get("optimizer") if isinstance(sharded, dict) else None
    if (
        not isinstance(model, list)
        or not all(isinstance(name, str) for name in model)
        or not isinstance(optimizer, list)
    ):
        raise CheckpointError(
            f"{source} is damaged: it has no valid 'sharded_tensors' list "
            "(the names of the tensors stored through DCP)."
        )
    states = meta.get("optimizer_states")
    for entry in optimizer:
        ok = (
            isinstance(entry, (list, tuple))
            and len(entry) == 3
            and type(entry[0]) is int
            and isinstance(entry[1], (int, str))
            and isinstance(entry[2], str)
        )
        if ok:
            index, pid, _ = entry
            ok = (
                isinstance(states, list)
                and 0 <= index < len(states)
                and isinstance(states[index], dict)
                and isinstance(states[index].get("state"), dict)
                and isinstance(states[index]["state"].get(pid), dict)
            )
        if not ok:
            raise CheckpointError(
                f"{source} is damaged: its sharded optimizer entry {entry!r} names no optimizer state in the file."
            )


def _tensor_keys(meta: dict[str, Any]) -> list[str]:
    sharded = meta["sharded_tensors"]
    return [_MODEL_PREFIX + name for name in sharded["model"]] + [
        f"{_OPTIMIZER_PREFIX}{i}/{pid}/{name}" for i, pid, name in sharded["optimizer"]
    ]


def _checked_metadata(directory: Path, meta: dict[str, Any]) -> Any:
    """DCP's metadata, checked to be that of the same save as ``meta`` and to hold every tensor ``meta`` lists."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(directory)
    saved_id = meta.get(_SAVE_ID)
    found_id = getattr(metadata.storage_meta, "save_id", None)
    if saved_id is not None and found_id != saved_id:
        raise CheckpointError(
            f"{directory / DCP_METADATA_FILE} belongs to another checkpoint: it was written by save {found_id!r},"
            f" {META_FILE} by save {saved_id!r}."
        )
    for key in _tensor_keys(meta):
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            state = "missing from" if entry is None else "not a tensor entry in"
            raise CheckpointError(
                f"{directory}: entry {key!r}, listed in {META_FILE}, is {state} {DCP_METADATA_FILE} (damaged, or the"
                " files come from different checkpoints)."
            )
    # Rank 0 writes META_FILE and lists its own parameters; a pipeline's other stages are listed in DCP's metadata,
    # which every rank's save fills.
    listed = set(meta["sharded_tensors"]["model"])
    meta["sharded_tensors"]["model"] += sorted(
        key[len(_MODEL_PREFIX) :]
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL_PREFIX)
        and key[len(_MODEL_PREFIX) :] not in listed
        and isinstance(entry, TensorStorageMetadata)
    )
    return metadata


def tensor_entries(path: str | os.PathLike) -> dict[str, Any]:
    """The tensors a sharded checkpoint holds: key -> DCP's metadata (``size``, ``properties.dtype``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(Path(path))
    return {
        key: entry for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)
    }


def _load(tensors: dict[str, Tensor], directory: Path, metadata: Any, no_dist: bool) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            # Reading a whole checkpoint in one process is the point of no_dist; DCP warns about it all the same.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(tensors, storage_reader=_safe_reader_class()(directory, metadata), no_dist=no_dist)
    except CheckpointError:
        raise
    except BaseException as error:
        _reraise_interrupt(error)
        # DCP wraps every rank's failure into a CheckpointException (a BaseException naming no file): give the first
        # CheckpointError raised by a reader (this rank's or another's), or one naming the directory.
        raised = next((e for e in _causes(error) if isinstance(e, CheckpointError)), None)
        if raised is not None:
            raise type(raised)(str(raised)) from None
        raise CheckpointError(
            f"{directory} cannot be read (damaged, or its files come from different checkpoints):"
            f" {_describe(_root_cause(error))}"
        ) from None


def load_whole(path: str | os.PathLike) -> dict[str, Any]:
    """Read a sharded checkpoint into one ordinary phalanx checkpoint with whole tensors (no process group needed)."""
    directory = Path(path)
    meta = read_meta(directory)
    metadata = _checked_metadata(directory, meta)
    entries = metadata.state_dict_metadata
    tensors = {
        key: torch.empty(tuple(entries[key].size), dtype=entries[key].properties.dtype) for key in _tensor_keys(meta)
    }
    _load(tensors, directory, metadata, no_dist=True)
    return _reassemble(meta, tensors)


def load_into(path: str | os.PathLike, module_state: dict[str, Tensor], optimizers: list[Any]) -> dict[str, Any]:
    """Read a sharded checkpoint into the shards of a live model (every rank calls this; DCP reshards as needed).

    ``module_state`` is the live module's ``state_dict()`` (tensors sharing storage with the module); with
    ``optimizers``, their per-parameter states are read as DTensors shaped like their parameters. Returns the
    whole checkpoint dictionary, its tensors being the live (sharded) ones.
    """
    directory = Path(path)
    meta = read_meta(directory)
    metadata = _checked_metadata(directory, meta)
    entries = metadata.state_dict_metadata
    tensors: dict[str, Tensor] = {}
    for name in meta["sharded_tensors"]["model"]:
        if name in module_state:
            tensors[_MODEL_PREFIX + name] = module_state[name]
    if optimizers and "optimizer_states" in meta:
        for index, pid, name in meta["sharded_tensors"]["optimizer"]:
            if index >= len(optimizers):
                continue
            parameters = [p for group in optimizers[index].param_groups for p in group["params"]]
            saved_ids = [
                i for group in meta["optimizer_states"][index].get("param_groups", []) for i in group.get("params", [])
            ]
            entry = entries[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"]
            # A state keyed by name (a pipeline's) may cover other stages: read whole tensors, cut when loaded.
            same = isinstance(pid, int) and pid in saved_ids and len(saved_ids) == len(parameters)
            parameter = parameters[saved_ids.index(pid)] if same else None
            if parameter is not None and is_dtensor(parameter) and tuple(entry.size) == tuple(parameter.shape):
                tensors[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"] = torch.empty_like(
                    parameter, dtype=entry.properties.dtype
                )
            else:
                tensors[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"] = torch.empty(
                    tuple(entry.size), dtype=entry.properties.dtype
                )
    _load(tensors, directory, metadata, no_dist=False)
    return _reassemble(meta, tensors)


def _reassemble(meta: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    sharded = meta.pop("sharded_tensors")
    meta.pop(_SAVE_ID, None)
    meta["state_dict"] = {
        name: tensors[_MODEL_PREFIX + name] for name in sharded["model"] if _MODEL_PREFIX + name in tensors
    }
    for index, pid, name in sharded["optimizer"]:  # each names an existing state (checked by _check_meta)
        key = f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"
        if key in tensors:
            meta["optimizer_states"][index]["state"][pid][name] = tensors[key]
    return meta
