"""What the strategy reports about the swarm, and the LR scheduler handle that lets hivemind step the schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SwarmProgress:
    """One peer's view of the collaborative run (``HivemindStrategy.swarm_progress``)."""

    #: This peer's swarm step (hivemind's ``local_epoch``): optimizer steps the swarm has taken together.
    epoch: int
    #: The step the swarm as a whole has reached (ahead of ``epoch`` while this peer catches up).
    global_epoch: int
    #: Samples accumulated by every peer towards the current step, as last read from the DHT.
    samples_accumulated: int
    #: Samples the swarm accumulates before each optimizer step.
    target_batch_size: int
    #: Peers training now (those that reported progress recently).
    num_peers: int
    #: Samples this peer contributed towards the current step.
    local_samples_accumulated: int


class SwarmScheduler:
    """Stands in for an LR scheduler in the driver's configs: hivemind steps the real one once per swarm step.

    The driver (the Trainer) steps schedulers per batch or per data epoch, which on a swarm means nothing: the
    learning rate must follow the swarm's step count, and a peer that joins late catches up when it downloads the
    state. ``step`` here therefore does nothing; everything else (``state_dict``, ``get_last_lr``, ``optimizer``, ...)
    is the real scheduler's.
    """

    def __init__(self, scheduler: Any) -> None:
        self.__dict__["scheduler"] = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: hivemind steps the wrapped scheduler when the swarm steps."""

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"SwarmScheduler({self.scheduler!r})"
