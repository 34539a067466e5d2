"""FaultTolerance: the options of a fault-tolerant run are checked when made, and read from the environment."""

from __future__ import annotations

from datetime import timedelta

import pytest

from phalanx.strategies import FaultTolerance


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replica_group_id": 0, "num_replica_groups": 0}, r"num_replica_groups=0\) must be an int >= 1"),
        ({"replica_group_id": -1, "num_replica_groups": 2}, r"replica_group_id=-1\) must be an int >= 0"),
        ({"replica_group_id": True, "num_replica_groups": 2}, r"replica_group_id=True\) must be an int"),
        ({"replica_group_id": 2, "num_replica_groups": 2}, r"must be below num_replica_groups=2"),
        ({"replica_group_id": 0, "num_replica_groups": 2, "min_replicas": 0}, r"min_replicas=0\) must be an int >= 1"),
        ({"replica_group_id": 0, "num_replica_groups": 2, "min_replicas": 3}, r"cannot exceed num_replica_groups=2"),
        ({"replica_group_id": 0, "num_replica_groups": 1, "quorum_timeout": 5}, r"quorum_timeout=5\) must be a pos"),
        (
            {"replica_group_id": 0, "num_replica_groups": 1, "step_timeout": timedelta(0)},
            r"step_timeout=.*\) must be a positive datetime.timedelta",
        ),
        ({"replica_group_id": 0, "num_replica_groups": 1, "lighthouse": "localhost:1"}, r"lighthouse's address"),
        ({"replica_group_id": 0, "num_replica_groups": 1, "transport": "nccl"}, r"choose one of \('http', 'pg'\)"),
    ],
    ids=[
        "no-groups", "negative-id", "bool-id", "id-too-high", "no-min", "min-above-groups", "timeout-number",
        "timeout-zero", "lighthouse-no-scheme", "unknown-transport",
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_the_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        FaultTolerance(**options)


def test_good_options_keep_their_values_and_defaults():
    options = FaultTolerance(replica_group_id=2, num_replica_groups=3, min_replicas=2, transport="pg")
    assert (options.replica_group_id, options.num_replica_groups, options.min_replicas) == (2, 3, 2)
    assert options.transport == "pg" and options.quorum_timeout == timedelta(seconds=60)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}, (1, 3, "http://localhost:29510")),
        (
            {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://head:29510"},
            (0, 2, "http://head:29510"),
        ),
    ],
)
def test_from_environment_reads_torchfts_variable_names(environ, expected):
    options = FaultTolerance.from_environment(environ)
    assert (options.replica_group_id, options.num_replica_groups, options.lighthouse) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, r"\['REPLICA_GROUP_ID', 'NUM_REPLICA_GROUPS'\] are not set"),
        ({"REPLICA_GROUP_ID": "0"}, r"\['NUM_REPLICA_GROUPS'\] are not set"),
        ({"REPLICA_GROUP_ID": "one", "NUM_REPLICA_GROUPS": "2"}, r"REPLICA_GROUP_ID='one' must be a whole number"),
        ({"REPLICA_GROUP_ID": "3", "NUM_REPLICA_GROUPS": "2"}, r"must be below num_replica_groups=2"),
    ],
    ids=["nothing", "no-count", "not-a-number", "id-too-high"],
)
def test_from_environment_refuses_missing_or_bad_variables(environ, message):
    with pytest.raises(ValueError, match=message):
        FaultTolerance.from_environment(environ)
