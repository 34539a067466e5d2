"""FaultTolerance: the options of a fault-tolerant run (which replica group this is, the quorum, the lighthouse)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

from phalanx.strategies.fault_tolerant.semi_sync import SemiSync
from phalanx.utilities.messages import shown

#: How a rejoining replica group receives the live state from a healthy peer (torchft's checkpoint transports).
TRANSPORTS = ("http", "pg")
#: The environment variables ``FaultTolerance.from_environment`` reads (torchft's own names where it has them).
ENVIRONMENT = {
    "replica_group_id": "REPLICA_GROUP_ID",
    "num_replica_groups": "NUM_REPLICA_GROUPS",
    "lighthouse": "TORCHFT_LIGHTHOUSE",
}


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"FaultTolerance({name}={shown(value)}) must be an int >= {minimum}.")


def _check_timeout(name: str, value: object) -> None:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(f"FaultTolerance({name}={shown(value)}) must be a positive datetime.timedelta.")


@dataclass(frozen=True)
class FaultTolerance:
    """Where this process's replica group stands in a fault-tolerant run, and how long each wait may last."""

    #: This replica group's id, 0 to ``num_replica_groups - 1`` (a restarted group keeps its id).
    replica_group_id: int
    #: How many replica groups the run has at most; each reads its own share of the data.
    num_replica_groups: int
    #: The fewest replica groups a step may commit with (fewer: the step waits, then is not committed).
    min_replicas: int = 1
    #: The lighthouse's address, e.g. "http://localhost:29510" (see ``start_lighthouse``).
    lighthouse: str = "http://localhost:29510"
    #: How long forming a quorum may wait for the replica groups (at the start of each step).
    quorum_timeout: timedelta = field(default_factory=lambda: timedelta(seconds=60))
    #: How long one step's cross-group work may wait: each collective (the gradient all-reduce), the commit vote, a
    #: state transfer.
    step_timeout: timedelta = field(default_factory=lambda: timedelta(seconds=60))
    #: How long connecting may wait: to the lighthouse, to a group's manager, and the groups' rendezvous when a new
    #: quorum forms (a group that dies during it is given up after this, and the step is declined).
    connect_timeout: timedelta = field(default_factory=lambda: timedelta(seconds=60))
    #: How a rejoining group receives the live state: "http" (torchft's HTTP server) or "pg" (its process group).
    transport: str = "http"
    #: Synchronise the groups every N steps with torchft's LocalSGD or DiLoCo instead of at every step (None).
    semi_sync: SemiSync | None = None

    def __post_init__(self) -> None:
        _check_count("num_replica_groups", self.num_replica_groups, 1)
        _check_count("replica_group_id", self.replica_group_id, 0)
        _check_count("min_replicas", self.min_replicas, 1)
        if self.replica_group_id >= self.num_replica_groups:
            raise ValueError(
                f"FaultTolerance(replica_group_id={self.replica_group_id}) must be below"
                f" num_replica_groups={self.num_replica_groups} (ids count from 0)."
            )
        if self.min_replicas > self.num_replica_groups:
            raise ValueError(
                f"FaultTolerance(min_replicas={self.min_replicas}) cannot exceed"
                f" num_replica_groups={self.num_replica_groups}: no step could ever commit."
            )
        for name in ("quorum_timeout", "step_timeout", "connect_timeout"):
            _check_timeout(name, getattr(self, name))
        if not isinstance(self.lighthouse, str) or not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"FaultTolerance(lighthouse={shown(self.lighthouse)}) must be the lighthouse's address, e.g."
                f" 'http://localhost:29510'."
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"FaultTolerance(transport={shown(self.transport)}) is not valid; choose one of {TRANSPORTS}."
            )
        if self.semi_sync is not None and not isinstance(self.semi_sync, SemiSync):
            raise TypeError(
                f"FaultTolerance(semi_sync=...) takes a SemiSync(algorithm, sync_every, outer_optimizer) or None, got"
                f" {type(self.semi_sync).__name__}."
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> FaultTolerance:
        """The options named by REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE (the defaults otherwise)."""
        environ = os.environ if environ is None else environ
        missing = [
            ENVIRONMENT[name] for name in ("replica_group_id", "num_replica_groups") if ENVIRONMENT[name] not in environ
        ]
        if missing:
            raise ValueError(
                f"strategy='ddp_ft' or 'hsdp_ft' without a FaultTolerance(...) reads the replica group from the"
                f" environment, but"
                f" {missing} are not set. Set REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (and TORCHFT_LIGHTHOUSE) in"
                f" each group's launch command, or pass the strategy's class (DDPFaultTolerantStrategy or"
                f" HSDPFaultTolerantStrategy) fault_tolerance=FaultTolerance(...)."
            )
        values: dict[str, object] = {}
        for name in ("replica_group_id", "num_replica_groups"):
            text = environ[ENVIRONMENT[name]]
            if not text.strip().isdigit():
                raise ValueError(f"{ENVIRONMENT[name]}={text!r} must be a whole number.")
            values[name] = int(text)
        if ENVIRONMENT["lighthouse"] in environ:
            values["lighthouse"] = environ[ENVIRONMENT["lighthouse"]]
        return cls(**values)  # type: ignore[arg-type]
