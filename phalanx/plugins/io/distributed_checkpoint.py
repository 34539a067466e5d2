"""Sharded checkpoint directories: tensors through torch.distributed.checkpoint (DCP), the rest in one plain file.

Layout of ``NAME.ckpt/``::

    .metadata, __<rank>_0.distcp   DCP: every rank writes its own shards of the module and optimizer tensors
    phalanx_meta.pt                  everything else of the checkpoint (loops, callbacks, RNG states, optimizer
                                     hyper-parameters...), plain values, loadable with weights_only=True
    .complete                        written last, once every rank has finished: only then is the checkpoint used

Only tensors go through DCP, so reading never needs DCP's pickled byte entries; DCP's own ``.metadata`` file is read
with an unpickler that accepts only DCP's metadata classes. A save goes to a hidden temporary directory that is
renamed into place when complete, so a crash mid-save leaves the previous checkpoint of that name intact.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from phalanx.plugins.io.directory import publish_directory, staging_directory, write_synced
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

META_FILE = "phalanx_meta.pt"
DCP_METADATA_FILE = ".metadata"
_MODEL_PREFIX = "model/"
_OPTIMIZER_PREFIX = "optimizer/"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint directory written by phalanx."""
    directory = Path(path)
    return directory.is_dir() and (directory / DCP_METADATA_FILE).exists() and (directory / META_FILE).exists()


# ---------------------------------------------------------------------------- splitting a checkpoint
def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Separate the module and sharded optimizer tensors (for DCP) from the plain rest (for the meta file)."""
    from phalanx.strategies.dtensor_state import is_dtensor

    tensors = {_MODEL_PREFIX + name: value for name, value in checkpoint.get("state_dict", {}).items()}
    meta = {key: value for key, value in checkpoint.items() if key != "state_dict"}
    moved: list[list[Any]] = []
    if "optimizer_states" in checkpoint:
        optimizer_states = []
        for index, state in enumerate(checkpoint["optimizer_states"]):
            per_parameter = {}
            for pid, entries in state["state"].items():
                kept = {}
                for name, value in entries.items():
                    if is_dtensor(value):
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
def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, *, is_global_zero: bool, broadcast: Callable[[Any], Any], barrier: Callable[[str], None]) -> None:
    """Write ``checkpoint`` as a sharded directory at ``path`` (every rank calls this; rank 0 finishes it)."""
    import torch.distributed.checkpoint as dcp

    from phalanx.plugins.io.torch_io import serialize

    target = Path(path)
    staging = staging_directory(target, is_global_zero=is_global_zero, broadcast=broadcast)
    tensors, meta = split_checkpoint(checkpoint)
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging))
        if is_global_zero:
            write_synced(staging / META_FILE, serialize(meta))
        barrier("sharded checkpoint written")
        if is_global_zero:
            publish_directory(staging, target)
    except BaseException:
        if is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------- reading
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``: DCP's metadata classes, torch dtypes and sizes, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"Refusing to read the DCP metadata: it references {module}.{name}, which is not part of DCP's metadata format.")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            with open(Path(self.path) / DCP_METADATA_FILE, "rb") as handle:
                try:
                    metadata = _MetadataUnpickler(handle).load()
                except UnsafeCheckpointError:
                    raise
                except Exception as error:
                    raise CheckpointError(f"{self.path} has an unreadable DCP metadata file: {type(error).__name__}: {error}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The plain part of a sharded checkpoint (without its tensors)."""
    from phalanx.plugins.io.torch_io import load_bytes

    directory = Path(path)
    if not is_sharded_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a sharded phalanx checkpoint (no {DCP_METADATA_FILE} and {META_FILE}).")
    return load_bytes((directory / META_FILE).read_bytes(), str(directory / META_FILE))


def tensor_entries(path: str | os.PathLike) -> dict[str, Any]:
    """The tensors a sharded checkpoint holds: key -> DCP's metadata (``size``, ``properties.dtype``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _reader(Path(path)).read_metadata()
    return {key: entry for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}


def _load(tensors: dict[str, Tensor], path: Path, no_dist: bool) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Reading a whole checkpoint in one process is the point of no_dist; DCP warns about it all the same.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(tensors, storage_reader=_reader(path), no_dist=no_dist)


def load_whole(path: str | os.PathLike) -> dict[str, Any]:
    """Read a sharded checkpoint into one ordinary phalanx checkpoint with whole tensors (no process group needed)."""
    directory = Path(path)
    meta = read_meta(directory)
    entries = tensor_entries(directory)
    tensors = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in entries.items()}
    _load(tensors, directory, no_dist=True)
    return _reassemble(meta, tensors)


def load_into(path: str | os.PathLike, module_state: dict[str, Tensor], optimizers: list[Any]) -> dict[str, Any]:
    """Read a sharded checkpoint into the shards of a live model (every rank calls this; DCP reshards as needed).

    ``module_state`` is the live module's ``state_dict()`` (tensors sharing storage with the module); with
    ``optimizers``, their per-parameter states are read as DTensors shaped like their parameters. Returns the
    whole checkpoint dictionary, its tensors being the live (sharded) ones.
    """
    from phalanx.strategies.dtensor_state import is_dtensor

    directory = Path(path)
    meta = read_meta(directory)
    entries = tensor_entries(directory)
    tensors: dict[str, Tensor] = {}
    for name in meta["sharded_tensors"]["model"]:
        if name in module_state:
            tensors[_MODEL_PREFIX + name] = module_state[name]
    if optimizers and "optimizer_states" in meta:
        for index, pid, name in meta["sharded_tensors"]["optimizer"]:
            if index >= len(optimizers):
                continue
            parameters = [p for group in optimizers[index].param_groups for p in group["params"]]
            saved_ids = [i for group in meta["optimizer_states"][index]["param_groups"] for i in group["params"]]
            entry = entries[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"]
            parameter = parameters[saved_ids.index(pid)] if pid in saved_ids and len(saved_ids) == len(parameters) else None
            if parameter is not None and is_dtensor(parameter) and tuple(entry.size) == tuple(parameter.shape):
                tensors[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"] = torch.empty_like(parameter, dtype=entry.properties.dtype)
            else:
                tensors[f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    _load(tensors, directory, no_dist=False)
    return _reassemble(meta, tensors)


def _reassemble(meta: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    sharded = meta.pop("sharded_tensors")
    meta["state_dict"] = {name: tensors[_MODEL_PREFIX + name] for name in sharded["model"] if _MODEL_PREFIX + name in tensors}
    for index, pid, name in sharded["optimizer"]:
        key = f"{_OPTIMIZER_PREFIX}{index}/{pid}/{name}"
        if key in tensors:
            meta["optimizer_states"][index]["state"][pid][name] = tensors[key]
    return meta


def consolidate(path: str | os.PathLike) -> dict[str, Any]:
    """One ordinary phalanx checkpoint from a checkpoint directory (sharded DCP, or DeepSpeed's)."""
    directory = Path(path)
    if is_sharded_checkpoint(directory):
        return load_whole(directory)
    try:
        from phalanx.strategies.deepspeed_checkpoint import is_deepspeed_checkpoint, load_deepspeed_checkpoint_as_full
    except ImportError:
        is_deepspeed_checkpoint = None  # type: ignore[assignment]
    if is_deepspeed_checkpoint is not None and is_deepspeed_checkpoint(directory):
        return load_deepspeed_checkpoint_as_full(directory)
    raise CheckpointError(f"{directory} is a directory but not a checkpoint phalanx can read: neither a sharded (DCP) checkpoint nor a DeepSpeed one.")

