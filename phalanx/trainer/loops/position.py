"""The fit loop's position (its counters and where it is in the epoch's data) that a (re)joining replica group takes
from a healthy peer."""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.trainer.loops.fit_loop import _IN_BATCHES, FitLoop

#: The counters a position holds, in the order an error lists them.
POSITION_KEYS = ("global_step", "epoch", "batches_done", "total_batches", "batches_stepped")


def loop_position(loop: FitLoop) -> dict[str, int]:
    """Where ``loop`` stands at the start of the optimizer step it is taking: that step's number, the epoch, and the
    step's first batch (of its accumulation window), from which a joining group then reads its own share."""
    # Called while the strategy forms the step's quorum, before the closure: the window's earlier batches are counted in
    # batches_done already, the step's last batch not yet.
    window = loop._accumulated
    return {
        "global_step": loop.global_step,
        "epoch": loop.current_epoch,
        "batches_done": loop.batches_done - window,
        "total_batches": loop.total_batches - window,
        "batches_stepped": loop.batches_stepped,
    }


def load_loop_position(loop: FitLoop, position: Mapping[str, int]) -> None:
    """Move ``loop``, before it starts training, to ``position``: it opens that epoch (``on_train_epoch_start`` runs)
    and reads the epoch's data from the position's batch on, as a resume inside an epoch does."""
    missing = [key for key in POSITION_KEYS if not isinstance(position.get(key), int)]
    if missing:
        raise ValueError(
            f"A loop position needs the integer counters {list(POSITION_KEYS)}, but {missing} are missing or not"
            f" integers in {dict(position)!r}."
        )
    loop.global_step = position["global_step"]
    loop.current_epoch = position["epoch"]
    loop.batches_done = position["batches_done"]
    loop.total_batches = position["total_batches"]
    loop.batches_stepped = position["batches_stepped"]
    # The fit loop then goes on inside the epoch at batches_done (FitLoop.run); the epoch was not opened here yet.
    loop.phase, loop._step_pending, loop._epoch_open, loop._epoch_start_rng = _IN_BATCHES, False, False, None


def catch_up_loop_position(loop: FitLoop, position: Mapping[str, int]) -> bool:
    """Inside an optimizer step, take a peer's counters (``loop_position`` of a group ahead in the same epoch): the
    step then counts as the peer's, and the loop ends the epoch with the peer. Returns whether ``loop`` moved.

    The data already read is not read again: the batch in hand trains in the peer's step, and the epoch's last batches
    (as many as steps were missed) are not read, the share a group loses for each quorum it missed.
    """
    window = loop._accumulated  # the window's earlier batches, which loop_position leaves out of the peer's count
    behind = position["batches_done"] - (loop.batches_done - window)
    if position["epoch"] != loop.current_epoch or behind < 0 or position["global_step"] < loop.global_step:
        return False
    loop.global_step = position["global_step"]
    loop.batches_done = position["batches_done"] + window
    loop.total_batches = position["total_batches"] + window
    loop.batches_stepped = position["batches_stepped"]
    return True
