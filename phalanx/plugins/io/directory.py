"""Checkpoint directories that appear whole or not at all (sharded and DeepSpeed checkpoints).

Every rank writes its part into one hidden staging directory next to the target; once all have finished, rank 0
writes the completion marker and renames the staging directory into place. A crash at any point leaves the previous
checkpoint of that name intact, and a hidden or unmarked directory is never chosen by ``ckpt_path="auto"``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable


def staging_directory(target: Path, *, is_global_zero: bool, broadcast: Callable[[Any], Any]) -> Path:
    """The hidden directory next to ``target`` that every rank writes into (rank 0 names it, all ranks agree)."""
    name = str(target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")) if is_global_zero else None
    return Path(broadcast(name))


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to the disk."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def publish_directory(staging: Path, target: Path) -> None:
    """Mark the finished ``staging`` directory complete and put it at ``target`` (on rank 0, after every rank wrote)."""
    from phalanx.trainer.checkpoint import COMPLETE_MARKER

    write_synced(staging / COMPLETE_MARKER, b"")
    # A directory cannot replace another in one rename: the old one is moved aside (hidden, never chosen by resume),
    # the new one moved in, then the old one deleted.
    retired = None
    if target.exists() or target.is_symlink():
        retired = target.with_name(f".{target.name}.{uuid.uuid4().hex}.old.tmp")
        os.replace(target, retired)
    os.replace(staging, target)
    _sync_directory(target.parent)
    if retired is not None:
        if retired.is_dir() and not retired.is_symlink():
            shutil.rmtree(retired, ignore_errors=True)
        else:
            retired.unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    # The renames are durable only once the directory entry itself is flushed.
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
