"""CheckpointIO: how checkpoint bytes reach storage and come back."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

_PathLike = str | os.PathLike


class CheckpointIO(ABC):
    """Saves, loads and removes checkpoint dictionaries at a path."""

    @abstractmethod
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` so that a crash never leaves a half-written file in its place."""

    @abstractmethod
    def load_checkpoint(self, path: _PathLike, map_location: Any | None = None) -> dict[str, Any]:
        """Read the checkpoint at ``path``."""

    @abstractmethod
    def remove_checkpoint(self, path: _PathLike) -> None:
        """Delete the checkpoint at ``path``."""

    def copy_checkpoint(self, source: _PathLike, target: _PathLike) -> None:
        """Put a copy of the finished checkpoint ``source`` (a file or a directory) at ``target``, atomically."""
        # The default copies the files at the paths (local, or fsspec URLs through the file system's own copy): right
        # for every IO that writes to the path it is given. An IO that stores checkpoints elsewhere overrides this,
        # or raises NotImplementedError: ModelCheckpoint then writes last.ckpt with a second save.
        from phalanx.plugins.io.copying import copy_checkpoint_files

        copy_checkpoint_files(source, target)

    def teardown(self) -> None:
        """Finish pending work and release resources."""
