"""CheckpointIO: how checkpoint bytes reach storage and come back."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

from phalanx.plugins.io import sharded_io

if TYPE_CHECKING:
    from phalanx.plugins.io.collectives import Collectives

_PathLike = str | os.PathLike


class CheckpointIO(ABC):
    """Saves, loads and removes checkpoints at a path, in the layout the strategy chooses."""

    # The protocol, by layout (the strategy picks the layout, the IO does every write, read and removal):
    # - one file (single_device, ddp, fsdp/model_parallel 'full'): save_checkpoint / load_checkpoint on rank 0;
    # - sharded DCP directory (fsdp/model_parallel 'sharded'): save_sharded_checkpoint / load_sharded_checkpoint,
    #   called on every rank;
    # - DeepSpeed directory: start_directory_checkpoint, then save_checkpoint + makedirs for every file DeepSpeed
    #   writes (through phalanx's DeepSpeed checkpoint engine), then finish_directory_checkpoint, on every rank;
    # - every layout: remove_checkpoint and copy_checkpoint (rank 0).
    # The directory methods have default implementations, so a subclass of the three abstract methods works as-is.

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
        # Lazy for import time: `from phalanx import Trainer` loads no copying code.
        from phalanx.plugins.io.copying import copy_checkpoint_files

        copy_checkpoint_files(source, target)

    def after_saves(self, step: Callable[[], None], *, otherwise: Callable[[], None] | None = None) -> None:
        """Run ``step`` once every save and copy issued before is written; where one failed, ``otherwise`` instead."""
        # ModelCheckpoint points last.ckpt at a new checkpoint and gives back a name's reservation this way, so that
        # neither happens before that checkpoint is whole. An IO whose saves are written when they return (this one)
        # runs step now; one that writes later (AsyncCheckpointIO) runs it after the writes queued before.
        step()

    def save_sharded_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: _PathLike,
        *,
        collectives: Collectives,
        storage_options: Any | None = None,
    ) -> None:
        """Write ``checkpoint`` as a sharded DCP directory at ``path`` (every rank calls this, with its shards)."""
        sharded_io.save_sharded_checkpoint(checkpoint, path, collectives=collectives, storage_options=storage_options)

    def load_sharded_checkpoint(
        self, path: _PathLike, *, module_state: dict[str, Any], optimizers: list[Any]
    ) -> dict[str, Any]:
        """Read the sharded directory at ``path`` into the live shards ``module_state`` and ``optimizers``."""
        return sharded_io.load_sharded_checkpoint(path, module_state=module_state, optimizers=optimizers)

    def start_directory_checkpoint(self, path: _PathLike, *, collectives: Collectives) -> str:
        """Return the hidden staging directory (the same on every rank) that a directory checkpoint is written to."""
        return sharded_io.start_directory(path, collectives=collectives)

    def makedirs(self, path: _PathLike) -> None:
        """Create the directory ``path`` (and its parents) inside a staging directory."""
        sharded_io.makedirs(path)

    def finish_directory_checkpoint(self, staging: _PathLike, path: _PathLike, *, collectives: Collectives) -> None:
        """Once every rank has written its files into ``staging``, mark it complete and publish it at ``path``."""
        sharded_io.finish_directory(staging, path, collectives=collectives)

    def teardown(self) -> None:
        """Finish pending work and release resources."""
