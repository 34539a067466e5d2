"""Collectives: what a CheckpointIO method that every rank calls needs to know of the other ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def _same(obj: Any, src: int = 0) -> Any:
    return obj


def _no_wait(name: str | None = None) -> None:
    return None


@dataclass(frozen=True)
class Collectives:
    """This rank, the number of ranks, and the two collectives a directory save needs (a single process: defaults).

    ``broadcast(obj)`` returns rank 0's ``obj`` on every rank; ``barrier(name)`` returns once every rank called it.
    """

    rank: int = 0
    world_size: int = 1
    broadcast: Callable[..., Any] = _same
    barrier: Callable[..., None] = _no_wait

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Collectives(world_size={self.world_size!r}): world_size must be an int >= 1.")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Collectives(rank={self.rank!r}): rank must be an int in [0, {self.world_size}).")

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the rank that finishes (publishes) a directory checkpoint."""
        return self.rank == 0

    @classmethod
    def of(cls, strategy: Any) -> Collectives:
        """The collectives of a strategy (anything with ``global_rank``, ``world_size``, ``broadcast``, ``barrier``)."""
        return cls(
            rank=int(strategy.global_rank),
            world_size=int(strategy.world_size),
            broadcast=strategy.broadcast,
            barrier=strategy.barrier,
        )


SINGLE_PROCESS = Collectives()
