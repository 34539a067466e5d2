"""AsyncCheckpointIO: saves on a background thread so training goes on while bytes are written."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from phalanx.plugins.io.checkpoint_io import CheckpointIO, _PathLike
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.apply import apply_to_tensors


def _snapshot(checkpoint: dict[str, Any]) -> dict[str, Any]:
    # Copy tensors now, on the caller's thread: the optimizer will keep updating the originals in place.
    return apply_to_tensors(checkpoint, lambda t: t.detach().to("cpu", copy=True))


class AsyncCheckpointIO(CheckpointIO):
    """Wraps another CheckpointIO; each save snapshots the state, then writes it on one background thread.

    An error raised by a background save is re-raised at the next save, load or removal, or at teardown.
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise TypeError(f"checkpoint_io must be a CheckpointIO, got {type(checkpoint_io).__name__}.")
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and queue the write."""
        self._raise_finished_errors()
        snapshot = _snapshot(checkpoint)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-checkpoint")
        self._pending.append(self._executor.submit(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options))

    def copy_checkpoint(self, source: _PathLike, target: _PathLike) -> None:
        """Queue the copy behind the saves already queued (one of them may be writing ``source``)."""
        self._raise_finished_errors()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-checkpoint")
        self._pending.append(self._executor.submit(self.checkpoint_io.copy_checkpoint, source, target))

    def load_checkpoint(self, path: _PathLike, map_location: Any | None = None) -> dict[str, Any]:
        """Wait for queued saves, then load."""
        self.wait()
        return self.checkpoint_io.load_checkpoint(path, map_location)

    def remove_checkpoint(self, path: _PathLike) -> None:
        """Wait for queued saves (one may be writing ``path``), then remove."""
        self.wait()
        self.checkpoint_io.remove_checkpoint(path)

    def wait(self) -> None:
        """Block until every queued save is written; re-raise the first error."""
        pending, self._pending = self._pending, []
        errors = [future.exception() for future in pending]
        for error in errors:
            if error is not None:
                raise RuntimeError(f"A background checkpoint save failed: {error}") from error

    def _raise_finished_errors(self) -> None:
        failed = next((f for f in self._pending if f.done() and f.exception() is not None), None)
        self._pending = [f for f in self._pending if not f.done()]
        if failed is not None:
            raise RuntimeError(f"A background checkpoint save failed: {failed.exception()}") from failed.exception()

    def teardown(self) -> None:
        """Finish all queued saves and stop the thread; re-raise a failed save's error."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self.checkpoint_io.teardown()
