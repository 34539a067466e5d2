"""The background half of AsyncCheckpointIO's directory checkpoints (sharded DCP and DeepSpeed directories).

Collectives in a background thread must not share a process group with the training loop's collectives (their order
would interleave differently on each rank), so the background work coordinates over a process group of its own,
created once, collectively, from the main thread (``checkpoint_group``). Every rank reports whether its writes
succeeded before rank 0 publishes: a failure on any rank publishes nothing, and every rank raises it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from phalanx.plugins.io import sharded_io  # read through the module on use: tests replace its storage_writer
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.serialization import discard
from phalanx.plugins.io.write_failures import describe, raise_recorded, root_cause, watch_writes
from phalanx.utilities.exceptions import CheckpointWriteError


def checkpoint_group(collectives: Collectives) -> Any:
    """A gloo process group for the background work (``None`` for one process); every rank calls this together."""
    import torch.distributed as dist

    if collectives.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def background_collectives(collectives: Collectives, group: Any) -> Collectives:
    """``collectives`` whose broadcast and barrier run over ``group`` (usable from the background thread)."""
    if group is None:
        return Collectives(rank=collectives.rank, world_size=collectives.world_size)
    import torch.distributed as dist

    def broadcast(obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=group)
        return holder[0]

    def barrier(name: str | None = None) -> None:
        dist.barrier(group=group)

    return Collectives(rank=collectives.rank, world_size=collectives.world_size, broadcast=broadcast, barrier=barrier)


def _all_ranks_succeeded(error: BaseException | None, cause: str, collectives: Collectives, group: Any) -> list[str]:
    """Every rank's failure (``rank N: cause``), gathered over ``group``: empty when every rank succeeded."""
    mine = None if error is None else f"rank {collectives.rank}: {cause}"
    if group is None:
        return [mine] if mine else []
    import torch.distributed as dist

    gathered: list[Any] = [None] * collectives.world_size
    dist.all_gather_object(gathered, mine, group=group)
    return [failure for failure in gathered if failure]


def finish_in_background(
    *,
    io: CheckpointIO,
    writes: list[Future],
    before_publish: Callable[[list[Any]], None] | None,
    staging: Any,
    path: Any,
    collectives: Collectives,
    group: Any,
) -> None:
    """Wait for this rank's ``writes``, agree with every rank that all succeeded, then publish through ``io``."""
    error: BaseException | None = None
    try:
        results = [write.result() for write in writes]
        for write in writes:
            raise_recorded(getattr(write, "phalanx_write_errors", []))
        if before_publish is not None and collectives.is_global_zero:
            before_publish(results)
    except BaseException as caught:  # reported to every rank below, then raised
        error = caught
    failures = _all_ranks_succeeded(error, _cause(error, writes), collectives, group)
    if failures:
        if collectives.is_global_zero:
            discard(staging)
        raise CheckpointWriteError(
            f"The background save of {path} failed ({'; '.join(failures)}). Nothing was published: the previous"
            f" checkpoint at {path}, if there is one, is unchanged."
        ) from error
    try:
        io.finish_directory_checkpoint(staging, path, collectives=background_collectives(collectives, group))
    except BaseException:
        if collectives.is_global_zero:
            discard(staging)  # unpublished (or published and renamed away: then it no longer exists)
        raise


def _cause(error: BaseException | None, writes: list[Future]) -> str:
    """What made this rank's writes fail, in words (the disk filling and its file, rather than torch's own error)."""
    if error is None:
        return ""
    recorded = [failure for write in writes for failure in getattr(write, "phalanx_write_errors", [])]
    cause = root_cause(error, recorded)
    return describe(cause) if isinstance(cause, OSError) and cause.errno else f"{type(error).__name__}: {error}"


def start_sharded_write(
    tensors: dict[str, Any],
    staging: Any,
    *,
    storage_options: Any | None,
    group: Any,
    distributed: bool,
    stager: Any = None,
) -> Future:
    """Stage ``tensors`` (copied off the training tensors, now) and write them in DCP's background thread."""
    import torch.distributed.checkpoint as dcp

    writer = sharded_io.storage_writer(staging, storage_options)
    recorded = watch_writes(writer)  # torch's zip writer hides a write's OSError behind its own error
    write = dcp.async_save(
        tensors, storage_writer=writer, process_group=group, no_dist=not distributed, async_stager=stager
    )
    # read by _cause if the write fails; with an async_stager, async_save returns a Future
    write.phalanx_write_errors = recorded  # type: ignore[union-attr]
    return write  # type: ignore[return-value]
