"""TorchCheckpointIO: torch.save / torch.load(weights_only=True) on local paths and fsspec URLs, written atomically."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from phalanx.plugins.io.checkpoint_io import CheckpointIO, _PathLike
from phalanx.plugins.io.formats import consolidate
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.serialization import _fsspec_filesystem, is_directory, is_url, load_file, save_file
from phalanx.plugins.io.sharded_io import local_copy


def _load_directory(path: _PathLike) -> dict[str, Any]:
    """A checkpoint directory of any layout in ``formats.FORMATS``, read whole: any strategy can resume from it."""
    checkpoint_layout(path)  # refuses a directory whose save did not finish
    if not is_url(path):
        return consolidate(path)
    with local_copy(path) as local:
        return consolidate(local)


class TorchCheckpointIO(CheckpointIO):
    """Writes with ``torch.save`` to a temporary file and renames it into place; reads with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None) -> None:
        """Serialise ``checkpoint`` and write it atomically to ``path``."""
        save_file(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: _PathLike, map_location: Any | None = None, *, mmap: bool = False
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` with ``weights_only=True`` (a sharded checkpoint directory is read whole).

        A file is read from the disk record by record, never into one buffer. ``mmap=True`` (a local file) returns
        tensors backed by the file instead, read from the disk only where they are used: a few tensors of a big
        checkpoint cost only their own bytes. Such tensors are copy-on-write (changing them never changes the file)
        and keep the file's blocks in use until they are freed, even if the file is deleted meanwhile.
        """
        if is_directory(path):
            return _load_directory(path)
        return load_file(path, map_location, mmap=mmap)

    def remove_checkpoint(self, path: _PathLike) -> None:
        """Delete ``path`` (a file, or a directory for sharded checkpoints)."""
        if is_url(path):
            fs, fs_path = _fsspec_filesystem(path)
            if fs.exists(fs_path):
                fs.rm(fs_path, recursive=True)
            return
        local = Path(path)
        if local.is_dir():
            shutil.rmtree(local)
        else:
            local.unlink(missing_ok=True)
