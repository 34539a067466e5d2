"""Reading DCP's ``.metadata`` file without running code from it, and checking it against its directory.

``.metadata`` is a pickle. It is read with an unpickler that resolves exactly the globals torch's DCP writes there
for tensors (its metadata dataclasses, ``torch.Size``, dtypes by name, the layout and memory-format helpers, paths)
and nothing else: no other name, no dotted name (``module.attr.attr`` would reach whatever the module imports), no
persistent ids. The result is then checked before DCP reads anything with it: every shard file it names is a plain
name inside the directory, exists and is long enough for the bytes it should hold, no entry needs a decoding
transform, and every tensor's chunks fit its size and cover it, so a damaged or hostile file gives one clear
``CheckpointError`` naming the file and the entry instead of an error deep inside DCP (or an allocation of whatever
size the file claims).
"""

from __future__ import annotations

import importlib
import math
import pickle
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import torch

from phalanx.plugins.io.bounded_reads import open_checkpoint_file
from phalanx.plugins.io.checkpoint_files import entry_inside
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

DCP_METADATA_FILE = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"
#: What torch 2.13's DCP pickles into ``.metadata`` for a state dict of tensors (module, name), exactly.
_ALLOWED_GLOBALS = frozenset(
    {
        (_DCP, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # layouts pickle as _get_layout("torch.strided"): a dictionary lookup
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the checkpoint was written to
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
#: Dtypes pickle as ``torch.<name>``; only the exact names of dtype objects are accepted.
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves the (module, name) pairs of ``_ALLOWED_GLOBALS`` and torch's dtypes; refuses everything else."""

    def __init__(self, file: BinaryIO, source: Path) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        # Every way a pickle names a global (GLOBAL, STACK_GLOBAL, INST, extension codes) arrives here with the final
        # strings, however they were built. The names are compared whole: "Metadata.__init__" or "os.system" are not
        # in the set, so the attribute chains pickle would otherwise follow are never walked.
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in _ALLOWED_GLOBALS:
            return getattr(importlib.import_module(module), name)
        raise UnsafeCheckpointError(
            f"Refusing to read {self._source}: it references {module}.{name}, which is not part of DCP's metadata "
            "format (unpickling it could run code chosen by the file's author). "
            "Only DCP's metadata classes, torch.Size, torch dtypes and paths are accepted there."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"Refusing to read {self._source}: it holds a persistent reference ({pid!r}), "
            "which DCP's metadata never does."
        )


def read_metadata(directory: Path) -> Any:
    """DCP's metadata of the checkpoint ``directory``, read without running its code, checked against the files."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = entry_inside(directory, DCP_METADATA_FILE, root=directory, what="DCP's metadata file")
    try:
        with open_checkpoint_file(path, str(directory / DCP_METADATA_FILE)) as handle:
            metadata = _MetadataUnpickler(handle, directory / DCP_METADATA_FILE).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is missing DCP's metadata file {DCP_METADATA_FILE}: the checkpoint is incomplete."
        ) from None
    except Exception as error:  # pickle raises many types for bytes it cannot parse
        raise CheckpointError(
            f"{directory / DCP_METADATA_FILE} is not DCP metadata phalanx can read (truncated, damaged or not written"
            f" by DCP): {type(error).__name__}: {error}"
        ) from None
    if type(metadata) is not Metadata:
        raise CheckpointError(f"{directory / DCP_METADATA_FILE} holds a {type(metadata).__name__}, not DCP's Metadata.")
    check_metadata(metadata, directory)
    return metadata


def check_metadata(metadata: Any, directory: Path) -> None:
    """Raise ``CheckpointError`` unless ``metadata`` describes readable tensors in files of ``directory``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    source = directory / DCP_METADATA_FILE
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{source} is damaged: its entry table or storage table is not a dictionary.")
    sizes = _check_storage(storage, directory)
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(
                f"{source} is damaged: entry {key!r} is a {type(entry).__name__}, not a tensor or bytes entry."
            )
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry, storage, sizes, directory)


def _check_storage(storage: dict[Any, Any], directory: Path) -> dict[str, int]:
    """Check every storage record; return the size of each shard file they name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    source = directory / DCP_METADATA_FILE
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{source} is damaged: storage record {index!r} is not a DCP storage record.")
        name = info.relative_path
        path = entry_inside(directory, name, root=directory, what=f"the shard file of entry {index.fqn!r}")
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"Refusing to read {source}: entry {index.fqn!r} needs the decoding transforms"
                f" {list(info.transform_descriptors)}; phalanx writes none."
            )
        if name not in sizes:
            if not path.is_file():
                raise CheckpointError(
                    f"{directory} is missing the shard file {name} (it holds entry {index.fqn!r}): "
                    "the checkpoint is incomplete."
                )
            sizes[name] = path.stat().st_size
        offset, length = info.offset, info.length
        if (
            type(offset) is not int
            or type(length) is not int
            or offset < 0
            or length <= 0
            or offset + length > sizes[name]
        ):
            end = offset + length if type(offset) is int and type(length) is int else "?"
            raise CheckpointError(
                f"{directory / name} is truncated or belongs to another checkpoint: "
                f"entry {index.fqn!r} should be at bytes {offset!r}..{end} but the file has {sizes[name]}."
            )
    return sizes


def _check_tensor(key: str, entry: Any, storage: dict[Any, Any], sizes: dict[str, int], directory: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties

    source = directory / DCP_METADATA_FILE
    dtype = entry.properties.dtype if isinstance(entry.properties, TensorProperties) else None
    shape = entry.size
    if not isinstance(dtype, torch.dtype) or not _is_shape(shape) or not isinstance(entry.chunks, list):
        raise CheckpointError(f"{source} is damaged: entry {key!r} has no valid dtype, size and chunk list.")
    itemsize = dtype.itemsize
    covered = 0
    for chunk in entry.chunks:
        offsets, chunk_sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (
            not _is_shape(offsets)
            or not _is_shape(chunk_sizes)
            or len(offsets) != len(shape)
            or len(chunk_sizes) != len(shape)
        ):
            raise CheckpointError(f"{source} is damaged: a chunk of entry {key!r} has no valid offsets and sizes.")
        if any(o + s > n for o, s, n in zip(offsets, chunk_sizes, shape)):
            raise CheckpointError(
                f"{source} is damaged: a chunk of entry {key!r} (offsets {list(offsets)}, sizes {list(chunk_sizes)})"
                f" lies outside its size {list(shape)}."
            )
        info = storage.get(MetadataIndex(key, offsets))
        if info is None:
            raise CheckpointError(
                f"{source} is damaged: the chunk at {list(offsets)} of entry {key!r} has no storage record."
            )
        # A chunk is stored with torch.save, which writes at least its elements: a record shorter than that would be
        # read from bytes that are not there, or the size is made up (an allocation of any size the file asks for).
        numel = math.prod(chunk_sizes)
        if numel * itemsize > info.length:
            raise CheckpointError(
                f"{source} is damaged or belongs to another checkpoint: entry {key!r} claims {numel} elements of"
                f" {dtype} in {info.length} bytes of {info.relative_path}."
            )
        covered += numel
    if covered != math.prod(shape):
        raise CheckpointError(
            f"{source} is damaged or belongs to another checkpoint: the chunks of entry {key!r} hold {covered} of its"
            f" {math.prod(shape)} elements."
        )


def _is_shape(value: Any) -> TypeGuard[torch.Size]:
    return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)


__all__ = ["DCP_METADATA_FILE", "check_metadata", "read_metadata"]
