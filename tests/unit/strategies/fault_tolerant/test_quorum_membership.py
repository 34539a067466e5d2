"""QuorumMembership in one process: the log lines for replica groups that leave and join, read from the global ranks
torchft reconfigures its process group with."""

from __future__ import annotations

import logging

import pytest

from phalanx.strategies.fault_tolerant.membership import QuorumMembership


class RecordingGroup:
    """Stands in for a torchft ProcessGroup: records the arguments of each reconfiguration."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def configure(self, *arguments: object) -> None:
        self.calls.append(arguments)


@pytest.mark.parametrize(
    ("processes", "quorums", "lines"),
    [
        (1, [[0, 1]], ["Replica group 0 joined quorum 1 of replica groups [0, 1]."]),
        (
            2,
            [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]],
            [
                "Replica group 0 joined quorum 1 of replica groups [0, 1].",
                "Replica group(s) [1] left the quorum (quorum 2): replica group 0 trains on with replica groups [0].",
                "Replica group(s) [1] joined the quorum (quorum 3): replica groups [0, 1] train together.",
            ],
        ),
        (
            1,
            [[0, 1, 2], [0, 3]],
            [
                "Replica group 0 joined quorum 1 of replica groups [0, 1, 2].",
                "Replica group(s) [1, 2] left the quorum (quorum 2): replica group 0 trains on with replica groups"
                " [0, 3].",
                "Replica group(s) [3] joined the quorum (quorum 2): replica groups [0, 3] train together.",
            ],
        ),
    ],
    ids=["first-quorum", "two-processes-leave-and-rejoin", "swap"],
)
def test_each_quorum_change_logs_who_left_and_who_joined(processes, quorums, lines, caplog):
    group, membership = RecordingGroup(), QuorumMembership(replica_group_id=0)
    membership.watch(group)
    with caplog.at_level(logging.INFO, logger="phalanx"):
        for quorum_id, ranks in enumerate(quorums, start=1):
            group.configure("store", "id", 0, len(ranks), quorum_id, 0, processes, ranks)
    assert [record.getMessage() for record in caplog.records] == lines
    assert len(group.calls) == len(quorums)  # torchft's own configure still runs, with every argument
    assert group.calls[-1][-1] == quorums[-1]
    assert list(membership.groups) == sorted({rank // processes for rank in quorums[-1]})
