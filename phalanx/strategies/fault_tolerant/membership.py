"""Says in the log which replica groups left or joined the quorum, from the membership torchft reconfigures with."""

from __future__ import annotations

from typing import Any

from phalanx.utilities.rank_zero import rank_zero_info


class QuorumMembership:
    """Follows the replica groups of each new quorum and logs (INFO, logger ``phalanx``) who left and who joined.

    torchft reconfigures the cross-group process group of every process at each quorum change, passing the global
    ranks of the quorum (``group id x processes per group + rank in the group``): the groups are read from those.
    """

    def __init__(self, replica_group_id: int) -> None:
        self.replica_group_id = replica_group_id
        #: The replica groups of the latest quorum (empty before the first).
        self.groups: tuple[int, ...] = ()

    def watch(self, process_group: Any) -> None:
        """Log every reconfiguration of ``process_group`` (a torchft ProcessGroup given to the Manager)."""
        configure = process_group.configure

        def configure_and_log(
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)
            if global_ranks is not None:
                self.update(sorted({r // max(group_world_size or 1, 1) for r in global_ranks}), quorum_id)

        # An attribute of this instance only: torchft's Manager calls ``pg.configure`` at each quorum change.
        process_group.configure = configure_and_log

    def update(self, groups: list[int], quorum_id: int | None) -> None:
        """Take the groups of a new quorum; log the change against the previous one."""
        previous, self.groups = self.groups, tuple(groups)
        me, members = self.replica_group_id, list(self.groups)
        if not previous:
            rank_zero_info(f"Replica group {me} joined quorum {quorum_id} of replica groups {members}.")
            return
        left = sorted(set(previous) - set(self.groups))
        joined = sorted(set(self.groups) - set(previous))
        if left:
            rank_zero_info(
                f"Replica group(s) {left} left the quorum (quorum {quorum_id}): replica group {me} trains on with"
                f" replica groups {members}."
            )
        if joined:
            together = f"replica groups {members} train together"
            rank_zero_info(f"Replica group(s) {joined} joined the quorum (quorum {quorum_id}): {together}.")
