"""Copying a finished checkpoint to a second name, atomically (``ModelCheckpoint(save_last=True)``'s ``last.ckpt``).

A single file is copied to a hidden temporary name next to the target, flushed, and renamed over the target, so the
target always names a complete checkpoint (the old one until the rename, the copy after). A checkpoint directory
(sharded or DeepSpeed layout) is rebuilt in a hidden staging directory and put in place by
:func:`~phalanx.plugins.io.directory.publish_directory`, as a directory save is. Its files are *hard-linked* where the
file system allows, else copied: phalanx never rewrites a checkpoint file in place (every write goes to a new
temporary and is renamed), so files shared by two checkpoints never change under either name, and a multi-gigabyte
sharded checkpoint is not written twice; removing one checkpoint only drops its names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from phalanx.plugins.io.directory import (
    COMPLETE_MARKER,
    publish_directory,
    refuse_unsafe_target,
    replace_with,
    sync_directory,
)
from phalanx.plugins.io.serialization import refuse_unsafe_url_target
from phalanx.plugins.io.temporaries import temporary_name


def copy_checkpoint_files(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put a copy of the checkpoint at ``source`` (a file or a directory; local or fsspec URL) at ``target``."""
    if "://" in str(source) or "://" in str(target):
        _copy_url(str(source), str(target))
        return
    source, target = Path(source), Path(target)
    if not source.exists():
        raise FileNotFoundError(f"Cannot copy the checkpoint {source}: it does not exist.")
    if os.path.realpath(source) == os.path.realpath(target):
        return  # already the same entry
    refuse_unsafe_target(target)  # before copying anything (publishing checks again)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(temporary_name(target.name))
    try:
        if source.is_dir():
            _link_tree(source, staging)
            publish_directory(staging, target)
            return
        _copy_file_synced(source, staging)
        replace_with(staging, target)
    except BaseException:
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging, ignore_errors=True)
        else:
            staging.unlink(missing_ok=True)
        raise
    sync_directory(target.parent)


def _copy_file_synced(source: Path, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, length=16 * 1024 * 1024)
        writer.flush()
        os.fsync(writer.fileno())


def _link_tree(source: Path, staging: Path) -> None:
    """Rebuild ``source`` under ``staging``: hard links where possible, else synced copies; links are not followed.

    Walked without recursion, so that however deep its folders nest, copying fails only as the file system does.
    """
    staging.mkdir()
    pending = [Path(".")]
    while pending:
        relative = pending.pop()
        with os.scandir(source / relative) as listing:
            entries = list(listing)
        for entry in entries:
            name, copy = entry.name, staging / relative / entry.name
            if relative == Path(".") and name == COMPLETE_MARKER:
                continue  # written afresh by publish_directory once the copy is whole (never through a shared link)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), copy)  # as written (checked on load like any checkpoint entry)
            elif entry.is_dir(follow_symlinks=False):
                copy.mkdir()
                pending.append(relative / name)
            else:
                try:
                    os.link(entry.path, copy)
                except OSError:  # another device, or a file system without hard links
                    _copy_file_synced(Path(entry.path), copy)


def _copy_url(source: str, target: str) -> None:
    import fsspec

    fs, source_path = fsspec.core.url_to_fs(source)
    target_fs, target_path = fsspec.core.url_to_fs(target)
    if type(target_fs) is not type(fs):
        raise ValueError(f"Cannot copy the checkpoint {source} to {target}: they are on different file systems.")
    if not fs.exists(source_path):
        raise FileNotFoundError(f"Cannot copy the checkpoint {source}: it does not exist.")
    refuse_unsafe_url_target(target_fs, target_path, target)
    parent, _, name = target_path.rpartition("/")
    temporary = f"{parent}/{temporary_name(name)}" if parent else temporary_name(name)
    directory = fs.isdir(source_path)
    try:
        fs.copy(source_path, temporary, recursive=directory)
        if directory and fs.exists(target_path):
            # Object stores have no atomic directory rename: the old copy goes just before the new one arrives.
            fs.rm(target_path, recursive=True)
        fs.mv(temporary, target_path, recursive=directory)
    except BaseException:
        _remove_quietly(fs, temporary)
        raise


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception:  # the original error is the one to report
        pass


__all__ = ["copy_checkpoint_files"]
