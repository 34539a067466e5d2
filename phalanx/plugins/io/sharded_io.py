"""CheckpointIO's default directory methods: sharded (DCP) and DeepSpeed directories, local or at an fsspec URL.

Local directories are staged in a hidden sibling directory and renamed into place (``directory.publish_directory``).
At an fsspec URL the same happens with the file system's own operations: every rank writes into a hidden staging
directory next to the target, rank 0 writes ``.complete`` last and moves the staging directory into place (the
previous checkpoint is moved aside first and removed only after). Object stores have no atomic rename of a
directory; a directory without its marker is never loaded (``layout.checkpoint_layout``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.directory import COMPLETE_MARKER, publish_directory, staging_directory
from phalanx.plugins.io.formats.dcp import load_into, save_sharded, split_checkpoint, write_meta
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.serialization import _fsspec_filesystem, discard, is_url, refuse_unsafe_url_target
from phalanx.plugins.io.temporaries import remove_stale_temporaries, temporary_name
from phalanx.plugins.io.write_failures import describe, raise_recorded, root_cause, watch_writes
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError


def _sibling(url: str, prefix: str, suffix: str) -> str:
    parent, _, name = str(url).rstrip("/").rpartition("/")
    return f"{parent}/{prefix}{name}.{uuid.uuid4().hex}{suffix}"


def _staging_url(url: str) -> str:
    """A hidden staging name beside ``url``; ``CheckpointWriteError`` where no checkpoint may be saved at ``url``."""
    fs, target = _fsspec_filesystem(url)
    refuse_unsafe_url_target(fs, target, url)
    parent, _, name = str(url).rstrip("/").rpartition("/")
    return f"{parent}/{temporary_name(name)}"


def _join(url: Any, name: str) -> str:
    return f"{str(url).rstrip('/')}/{name}"


# ---------------------------------------------------------------------------- directory checkpoints
def start_directory(path: Any, *, collectives: Collectives) -> str:
    """The hidden staging directory next to ``path`` (named by rank 0, the same on every rank)."""
    if not is_url(path):
        target = Path(path).absolute()
        return str(
            staging_directory(target, is_global_zero=collectives.is_global_zero, broadcast=collectives.broadcast)
        )
    named: tuple[str | None, str | None] = (None, None)
    if collectives.is_global_zero:
        try:
            named = (_staging_url(str(path)), None)
        except CheckpointWriteError as error:
            named = (None, str(error))
    name, refusal = collectives.broadcast(named)
    if refusal is not None:
        raise CheckpointWriteError(refusal)  # on every rank, before anything is written
    return name


def makedirs(path: Any) -> None:
    """Create the directory ``path`` with its parents, locally or at an fsspec URL."""
    if is_url(path):
        fs, root = _fsspec_filesystem(path)
        fs.makedirs(root, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def publish(staging: Any, path: Any) -> None:
    """Mark the finished ``staging`` complete and put it at ``path`` (rank 0, after every rank wrote)."""
    if not is_url(path):
        publish_directory(Path(staging), Path(path).absolute())
        return
    fs, target = _fsspec_filesystem(path)
    _, staged = _fsspec_filesystem(staging)
    refuse_unsafe_url_target(fs, target, path)
    fs.pipe_file(_join(staged, COMPLETE_MARKER), b"")
    retired = None
    if fs.exists(target):
        retired = _fsspec_filesystem(_sibling(str(path), ".", ".retired"))[1]
        fs.mv(target, retired, recursive=True)
    fs.mv(staged, target, recursive=True)
    if retired is not None:
        fs.rm(retired, recursive=True)
    remove_stale_temporaries(target.rstrip("/").rpartition("/")[0], fs=fs)


def finish_directory(staging: Any, path: Any, *, collectives: Collectives) -> None:
    """Wait for every rank's files, publish on rank 0, then let every rank go on once the checkpoint is in place."""
    collectives.barrier("phalanx: directory checkpoint written")
    if collectives.is_global_zero:
        publish(staging, path)
    collectives.barrier("phalanx: directory checkpoint published")


# ---------------------------------------------------------------------------- sharded (DCP) directories
def storage_writer(staging: Any, storage_options: Any | None = None) -> Any:
    """DCP's writer for ``staging``: the local file system writer, or torch's fsspec writer for URLs."""
    import torch.distributed.checkpoint as dcp

    if is_url(staging):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(staging), **(storage_options or {}))
    return dcp.FileSystemWriter(staging)


def save_sharded_checkpoint(
    checkpoint: dict[str, Any], path: Any, *, collectives: Collectives, storage_options: Any | None = None
) -> None:
    """Every rank writes its shards of ``checkpoint`` into a staging directory; rank 0 publishes it at ``path``."""
    import torch.distributed.checkpoint as dcp

    if not is_url(path):
        if storage_options is not None:
            raise TypeError(f"storage_options are only used for fsspec URLs, not for the local path {str(path)!r}.")
        save_sharded(
            checkpoint,
            path,
            is_global_zero=collectives.is_global_zero,
            broadcast=collectives.broadcast,
            barrier=collectives.barrier,
        )
        return
    staging = start_directory(path, collectives=collectives)
    tensors, meta = split_checkpoint(checkpoint)
    writer = storage_writer(staging, storage_options)
    recorded = watch_writes(writer)  # torch's zip writer hides a write's OSError behind its own error
    try:
        try:
            metadata = dcp.save(tensors, storage_writer=writer)
            raise_recorded(recorded)
            if collectives.is_global_zero:
                write_meta(staging, meta, metadata)
        except BaseException as error:
            cause = root_cause(error, recorded)
            reason = (
                describe(cause) if isinstance(cause, OSError) and cause.errno else f"{type(error).__name__}: {error}"
            )
            raise CheckpointWriteError(
                f"Could not write the sharded checkpoint {path}: {reason}. Nothing was published: the previous"
                f" checkpoint at {path}, if there is one, is unchanged."
            ) from error
        collectives.barrier("phalanx: sharded checkpoint written")
        if collectives.is_global_zero:
            publish(staging, path)
    except BaseException:
        if collectives.is_global_zero:
            discard(staging)
        raise


def load_sharded_checkpoint(path: Any, *, module_state: dict[str, Any], optimizers: list[Any]) -> dict[str, Any]:
    """Read a sharded directory into the live shards; a URL is first copied to a local temporary directory (every
    check that guards a local read then applies to it)."""
    layout = checkpoint_layout(path)
    if layout != "sharded":
        raise CheckpointError(f"{path} is a {layout} checkpoint, not a sharded (DCP) directory.")
    if not is_url(path):
        return load_into(Path(path), module_state, optimizers)
    with local_copy(path) as local:
        return load_into(local, module_state, optimizers)


@contextlib.contextmanager
def local_copy(url: Any) -> Any:
    """A local temporary copy of the checkpoint directory at ``url``, removed on exit."""
    scratch = Path(tempfile.mkdtemp(prefix="phalanx-checkpoint-"))
    try:
        local = scratch / "checkpoint"
        copy_tree(url, local)
        yield local
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def copy_tree(url: Any, local: Path) -> None:
    """Copy the directory at the fsspec ``url`` to the new local directory ``local``, refusing entries outside it."""
    fs, root = _fsspec_filesystem(url)
    local.mkdir()
    for remote in fs.find(root):
        relative = remote[len(root.rstrip("/")) + 1 :] if remote.startswith(root.rstrip("/")) else None
        if not relative or relative.startswith("/") or ".." in relative.split("/"):
            raise CheckpointError(f"{url}: the entry {remote!r} does not lie inside the checkpoint directory.")
        destination = local / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(destination))
