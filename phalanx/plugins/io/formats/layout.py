"""Which layout a checkpoint path holds: one file, a sharded (DCP) directory, a DeepSpeed directory or xla_fsdp's
sharded directory: one of the layouts that ``phalanx.plugins.io.formats.FORMATS`` lists.

Every strategy's ``load_checkpoint`` asks ``checkpoint_layout`` first, for local paths and fsspec URLs alike, so that
the three layouts follow one rule: a directory is a checkpoint only once its ``.complete`` marker is there.
"""

from __future__ import annotations

import os
from typing import Any

from phalanx.plugins.io.directory import COMPLETE_MARKER, incomplete
from phalanx.plugins.io.formats import directory_formats
from phalanx.plugins.io.serialization import _fsspec_filesystem, is_url
from phalanx.utilities.exceptions import CheckpointError


def checkpoint_layout(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """The layout of the checkpoint at ``path`` (local path or fsspec URL): a ``Format.name`` of ``FORMATS``.

    Raises ``FileNotFoundError`` when nothing is there and ``CheckpointError`` (naming the path and what is missing)
    for a directory that is not a complete checkpoint: one whose save has not finished is never loaded.
    """
    if is_url(path):
        fs, root = _fsspec_filesystem(path, storage_options)
        exists, isdir = fs.exists, fs.isdir
        join = lambda name: f"{root.rstrip('/')}/{name}"  # noqa: E731
    else:
        root = os.fspath(path)
        exists, isdir = os.path.exists, os.path.isdir
        join = lambda name: os.path.join(root, name)  # noqa: E731
    if not exists(root):
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    if not isdir(root):
        return "file"
    layouts = directory_formats()
    present = {name for entry in layouts for name in entry.files if exists(join(name))}
    for entry in layouts:
        if all(name in present for name in entry.files):
            if not exists(join(COMPLETE_MARKER)):
                raise incomplete(path, entry.name)
            return entry.name
    found = sorted(present)
    holds = "; ".join(f"{entry.title} one holds {', '.join(entry.files)}" for entry in layouts)
    raise CheckpointError(
        f"{path} is a directory but not a complete checkpoint: {holds} (found: {', '.join(found) or 'none of them'})."
    )
