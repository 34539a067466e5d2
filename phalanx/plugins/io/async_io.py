"""AsyncCheckpointIO: saves on a background thread so training goes on while bytes are written."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from phalanx.plugins.io.async_directory import checkpoint_group, finish_in_background, start_sharded_write
from phalanx.plugins.io.checkpoint_io import CheckpointIO, _PathLike
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.directory import refuse_unsafe_target
from phalanx.plugins.io.formats.dcp import split_checkpoint, write_meta
from phalanx.plugins.io.serialization import is_url
from phalanx.plugins.io.staging import StagedAlready, StagingBuffers
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.rank_zero import rank_zero_warn


def _snapshot(checkpoint: dict[str, Any]) -> dict[str, Any]:
    # Copy tensors now, on the caller's thread: the optimizer will keep updating the originals in place.
    return apply_to_tensors(checkpoint, lambda t: t.detach().to("cpu", copy=True))


class AsyncCheckpointIO(CheckpointIO):
    """Wraps another CheckpointIO; each save snapshots the state, then writes it on one background thread.

    Every layout: one file (snapshot, then the wrapped IO's ``save_checkpoint`` in the background); sharded (DCP's
    ``async_save`` into the wrapped IO's staging directory, published by its ``finish_directory_checkpoint`` once
    every rank's write finished); DeepSpeed (each file snapshotted and saved in the background, the directory
    published in the background after every rank's files). A wrapped IO that overrides ``save_sharded_checkpoint``
    writes its sharded checkpoints itself, synchronously (with a warning). A new save first waits for the one in
    flight. An error raised by a background save is re-raised at the next save, load or removal, or at teardown.
    ``reuse_staging_buffers`` keeps the CPU copies between saves (one more copy of the checkpoint's tensors in
    memory; staging is then a copy, not an allocation).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, *, reuse_staging_buffers: bool = True) -> None:
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise TypeError(f"checkpoint_io must be a CheckpointIO, got {type(checkpoint_io).__name__}.")
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._group: Any = None  # the process group of the background collectives (see async_directory)
        self._group_made = False
        self._directory_writes: list[Future] = []  # this rank's file writes of the directory being saved
        self._directory_open = False
        self._directory_in_turn = False  # ranks without a process group: the directory is written synchronously
        self._staging = StagingBuffers(reuse=reuse_staging_buffers)
        self._warned_synchronous = False
        self._warned_in_turn = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and queue the write."""
        if self._directory_in_turn:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
            return
        if self._directory_open:  # one of a directory's files: staged under its name (start_... waited already)
            self._raise_finished_errors()
            snapshot = self._staging.stage(checkpoint, ("file", _name(path)))
        else:
            self.wait()  # the save in flight may still be writing from the staging buffers
            if isinstance(self.checkpoint_io, TorchCheckpointIO) and not is_url(path):
                refuse_unsafe_target(path)  # here, not at the next save: the background write would refuse it later
            snapshot = self._staging.stage(checkpoint, ("one file",))
        future = self._submit(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options)
        if self._directory_open:
            self._directory_writes.append(future)

    def _submit(self, function: Any, *args: Any, **kwargs: Any) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-checkpoint")
        future = self._executor.submit(function, *args, **kwargs)
        self._pending.append(future)
        return future

    def _background_group(self, collectives: Collectives) -> Any:
        if not self._group_made:  # every rank reaches this together, in the main thread
            self._group = checkpoint_group(collectives)
            self._group_made = True
        return self._group

    def save_sharded_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: _PathLike,
        *,
        collectives: Collectives,
        storage_options: Any | None = None,
    ) -> None:
        """Stage the shards (DCP's ``async_save`` copies them off the training tensors), write and publish them in
        the background; returns once staged. A wrapped IO that overrides this method saves synchronously, itself."""
        self.wait()  # the save in flight finishes first (and its error, if any, is raised here)
        if _overrides_sharded_save(self.checkpoint_io):
            self._warn_synchronous_sharded_save()
            self.checkpoint_io.save_sharded_checkpoint(
                checkpoint, path, collectives=collectives, storage_options=storage_options
            )
            return
        group = self._background_group(collectives)
        staging = self.checkpoint_io.start_directory_checkpoint(path, collectives=collectives)
        tensors, meta = split_checkpoint(checkpoint)
        tensors = self._staging.stage(tensors, ("sharded",))  # DTensors stay DTensors: this rank's shards copied
        meta = _snapshot(meta)
        write = start_sharded_write(
            tensors,
            staging,
            storage_options=storage_options,
            group=group,
            distributed=group is not None,
            stager=StagedAlready(),
        )
        self._submit(
            finish_in_background,
            io=self.checkpoint_io,
            writes=[write],
            before_publish=lambda results: write_meta(staging, meta, results[0]),
            staging=staging,
            path=path,
            collectives=collectives,
            group=group,
        )

    def _warn_synchronous_sharded_save(self) -> None:
        if self._warned_synchronous:
            return
        self._warned_synchronous = True
        name = type(self.checkpoint_io).__name__
        rank_zero_warn(
            f"{name} overrides save_sharded_checkpoint, so AsyncCheckpointIO lets it write sharded checkpoints itself,"
            " on the training thread: those saves block the loop (a background thread cannot run the collectives an"
            " override may make on the training process group). To write them in the background, customise"
            f" {name}'s start_directory_checkpoint / finish_directory_checkpoint instead; AsyncCheckpointIO writes"
            " the shards into the staging directory the first returns and publishes through the second."
        )

    def load_sharded_checkpoint(
        self, path: _PathLike, *, module_state: dict[str, Any], optimizers: list[Any]
    ) -> dict[str, Any]:
        """Wait for queued saves, then load through the wrapped IO."""
        self.wait()
        return self.checkpoint_io.load_sharded_checkpoint(path, module_state=module_state, optimizers=optimizers)

    def start_directory_checkpoint(self, path: _PathLike, *, collectives: Collectives) -> str:
        """Wait for the save in flight; then the wrapped IO's staging directory."""
        self.wait()
        group = self._background_group(collectives)
        # Ranks that share no torch.distributed group (torch_xla's replica threads) cannot agree from a background
        # thread that every rank's files are written: the directory is then written and published now.
        self._directory_in_turn = group is None and collectives.world_size > 1
        if self._directory_in_turn and not self._warned_in_turn:
            self._warned_in_turn = True
            rank_zero_warn(
                "AsyncCheckpointIO writes directory checkpoints synchronously here: the ranks share no"
                " torch.distributed process group, which the background publish needs (one-file checkpoints"
                " still save in the background)."
            )
        self._directory_writes, self._directory_open = [], not self._directory_in_turn
        return self.checkpoint_io.start_directory_checkpoint(path, collectives=collectives)

    def makedirs(self, path: _PathLike) -> None:
        """Create the directory now (the files queued after it go there)."""
        self.checkpoint_io.makedirs(path)

    def finish_directory_checkpoint(self, staging: _PathLike, path: _PathLike, *, collectives: Collectives) -> None:
        """Publish in the background, once every rank's queued files are written."""
        if self._directory_in_turn:
            self._directory_in_turn = False
            self.checkpoint_io.finish_directory_checkpoint(staging, path, collectives=collectives)
            return
        writes, self._directory_writes, self._directory_open = self._directory_writes, [], False
        self._submit(
            finish_in_background,
            io=self.checkpoint_io,
            writes=writes,
            before_publish=None,
            staging=staging,
            path=path,
            collectives=collectives,
            group=self._background_group(collectives),
        )

    def copy_checkpoint(self, source: _PathLike, target: _PathLike) -> None:
        """Queue the copy behind the saves already queued (one of them may be writing ``source``); skipped when one
        of them failed (``source`` is then not whole, and ``target`` keeps what it held)."""
        self._raise_finished_errors()
        self.after_saves(lambda: self.checkpoint_io.copy_checkpoint(source, target))

    def after_saves(self, step: Callable[[], None], *, otherwise: Callable[[], None] | None = None) -> None:
        """Queue ``step`` behind the writes queued so far; ``otherwise`` runs instead if one of them failed (whose
        error is raised at the next save, load, removal or teardown, as always)."""
        earlier = list(self._pending)

        def run() -> None:
            # One worker runs the queue in order: every earlier write has finished by now.
            if any(future.exception() is not None for future in earlier):
                if otherwise is not None:
                    otherwise()
                return
            step()

        self._submit(run)

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
            self._staging.clear()
            self._group, self._group_made = None, False  # a later fit may bring a new default process group
            self.checkpoint_io.teardown()


def _overrides_sharded_save(io: CheckpointIO) -> bool:
    """Whether ``io`` writes sharded checkpoints its own way (then it must do so itself: its writes are the point)."""
    return type(io).save_sharded_checkpoint is not CheckpointIO.save_sharded_checkpoint


def _name(path: _PathLike) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]
