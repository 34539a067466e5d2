"""The learning-rate schedulers' part of the live state a healthy replica group sends one that (re)joins the run."""

from __future__ import annotations

from typing import Any, Sequence

from phalanx.optimization import LRSchedulerConfig


def scheduler_states(configs: Sequence[LRSchedulerConfig]) -> list[dict[str, Any]]:
    """Each scheduler's ``state_dict()``, in the order ``configure_optimizers`` returned them."""
    return [config.scheduler.state_dict() for config in configs]


def load_scheduler_states(configs: Sequence[LRSchedulerConfig], states: Sequence[dict[str, Any]] | None) -> None:
    """Load a peer's ``scheduler_states`` into this group's schedulers (after its optimizer state: the learning rates
    then count from the peer's step, not from this group's start). None: the peer sent none (an older phalanx)."""
    if states is None:
        return
    if len(states) != len(configs):
        raise ValueError(
            f"A peer replica group sent the state of {len(states)} learning-rate scheduler(s), but this group's"
            f" configure_optimizers made {len(configs)}. Every replica group must run the same model and schedulers."
        )
    for config, state in zip(configs, states):
        config.scheduler.load_state_dict(state)
