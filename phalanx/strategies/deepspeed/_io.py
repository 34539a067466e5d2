"""DeepSpeed checkpoint directories written through the strategy's CheckpointIO.

DeepSpeed writes its files through ``engine.checkpoint_engine``. While ``DeepSpeedStrategy.save_checkpoint`` runs,
phalanx puts an engine of its own there whose ``makedirs``/``save`` call the CheckpointIO (``makedirs`` and
``save_checkpoint``, one call per file), so a custom, remote (fsspec) or asynchronous IO sees and writes every
file; the directory is staged and published by the IO (``start_directory_checkpoint`` /
``finish_directory_checkpoint``). Resuming reads DeepSpeed's files through
the same IO's ``load_checkpoint`` (``deepspeed_files.safe_engine_reads``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from phalanx.plugins.io.async_io import AsyncCheckpointIO
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.directory import write_synced
from phalanx.plugins.io.serialization import _fsspec_filesystem, is_url
from phalanx.plugins.io.sharded_io import copy_tree


@functools.cache
def _engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class IOCheckpointEngine(CheckpointEngine):
        """DeepSpeed's checkpoint engine, writing every file through a phalanx CheckpointIO."""

        def __init__(self, io: CheckpointIO, original: Any) -> None:
            super().__init__(None)
            self.name = "phalanx.IOCheckpointEngine"
            self.io = io
            self.original = original

        def create(self, info: Any) -> None:
            return None

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            self.io.makedirs(path)

        def save(self, state_dict: Any, path: str) -> None:
            self.io.save_checkpoint(state_dict, path)

        def load(self, path: str, map_location: Any = None) -> Any:
            return self.original.load(path, map_location=map_location)

        def commit(self, info: Any) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            # True makes DeepSpeed clone every tensor before handing it over (so that a view does not save its whole
            # flat buffer). AsyncCheckpointIO copies each tensor into its own staging buffer anyway: no clone twice.
            return not isinstance(self.io, AsyncCheckpointIO)

    return IOCheckpointEngine


@contextmanager
def writes_through(engine: Any, io: CheckpointIO) -> Iterator[None]:
    """While active, every file ``engine`` saves goes through ``io``."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = _engine_class()(io, original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


def _write_text(path: str, text: str) -> None:
    if is_url(path):
        fs, root = _fsspec_filesystem(path)
        fs.pipe_file(root, text.encode())
    else:
        write_synced(Path(path), text.encode())


def save_deepspeed_directory(
    engine: Any,
    io: CheckpointIO,
    state: dict[str, Any] | None,
    path: Any,
    *,
    tag: str,
    state_file: str,
    collectives: Collectives,
    exclude_frozen_parameters: bool,
) -> None:
    """Every rank: DeepSpeed writes its partitions into the IO's staging directory; rank 0 adds ``state`` (the
    Trainer's) and the ``latest`` tag file; the IO publishes the directory at ``path`` once every rank is done."""
    staging = io.start_directory_checkpoint(path, collectives=collectives)
    if is_url(staging):
        # DeepSpeed copies its zero_to_fp32.py scripts in with shutil, past the checkpoint engine; at a URL they are
        # left out (``phalanx checkpoint consolidate`` does their work).
        engine._copy_recovery_script = lambda save_path: None
    try:
        with writes_through(engine, io):
            # save_latest=False: DeepSpeed would write 'latest' with open(), past the IO; phalanx writes it below.
            engine.save_checkpoint(
                staging,
                tag=tag,
                client_state={},
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
    finally:
        engine.__dict__.pop("_copy_recovery_script", None)  # local saves copy the scripts again
    if collectives.is_global_zero:
        assert state is not None
        io.save_checkpoint(state, f"{str(staging).rstrip('/')}/{state_file}")
        _write_text(f"{str(staging).rstrip('/')}/latest", tag)
    io.finish_directory_checkpoint(staging, path, collectives=collectives)


def local_copy_for_resume(url: Any, owner: Any) -> str:
    """A local copy of the DeepSpeed directory at ``url`` (DeepSpeed's engine reads local files only), removed when
    ``owner`` is garbage-collected or the process exits."""
    import shutil
    import tempfile
    import weakref
    from pathlib import Path

    scratch = tempfile.mkdtemp(prefix="phalanx-deepspeed-")
    weakref.finalize(owner, shutil.rmtree, scratch, True)
    local = Path(scratch) / "checkpoint"
    copy_tree(url, local)
    return str(local)
