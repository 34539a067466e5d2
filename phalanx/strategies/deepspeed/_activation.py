"""DeepSpeed activation checkpointing: the ``activation_checkpointing`` section of the DeepSpeed config, from the
DeepSpeedStrategy arguments Lightning has (``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``, ``synchronize_checkpoint_boundary``).

These settings only shape what ``deepspeed.checkpointing.checkpoint(function, *args)`` does when the model calls it
(its forward decides what is recomputed); the strategy hands them to ``deepspeed.checkpointing.configure`` when the
engine is built. An explicit ``config=`` keeps its own values: an argument asking for a different value is refused;
one the config leaves out is added to it.
"""

from __future__ import annotations

from typing import Any

SECTION = "activation_checkpointing"
#: The DeepSpeedStrategy arguments, which are also the keys of the config section.
ARGUMENTS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
)


def activation_settings(**flags: Any) -> dict[str, bool]:
    """Check the four arguments (bools) and return those turned on, as config entries."""
    for name, value in flags.items():
        if name not in ARGUMENTS:
            raise TypeError(f"{name!r} is not an activation checkpointing argument; valid: {list(ARGUMENTS)}.")
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} is not valid; pass True or False.")
    return {name: True for name, value in flags.items() if value}


def merge_activation_section(
    config: dict[str, Any], settings: dict[str, bool], *, source: str = "config"
) -> dict[str, Any]:
    """Add ``settings`` to ``config``'s ``activation_checkpointing`` section (in place) and return the checked section.

    Raises ValueError when the config sets one of them differently, or when the result cannot work
    (``contiguous_memory_optimization`` needs ``partition_activations`` and ``number_checkpoints``).
    """
    section = config.get(SECTION)
    if section is None:
        if not settings:
            return {}
        section = config[SECTION] = {}
    if not isinstance(section, dict):
        raise ValueError(
            f"The DeepSpeed {source} has {SECTION}={section!r}; it must be a dict of settings (e.g."
            " {'partition_activations': True})."
        )
    for key, value in settings.items():
        if key in section and section[key] != value:
            raise ValueError(
                f"DeepSpeedStrategy({key}={value}) conflicts with the {source}'s {SECTION}[{key!r}]={section[key]!r};"
                " set it in one place (the explicit config wins when the argument is left at its default)."
            )
        section[key] = value
    if section.get("contiguous_memory_optimization"):
        if not section.get("partition_activations"):
            raise ValueError(
                "contiguous_memory_optimization=True needs partition_activations=True (DeepSpeed copies partitioned"
                " activations only)."
            )
        if section.get("number_checkpoints") is None:
            raise ValueError(
                "contiguous_memory_optimization=True needs the number of checkpointed layers to size its buffer: pass"
                f" config={{'{SECTION}': {{'number_checkpoints': N, ...}}, ...}} (N: calls to"
                " deepspeed.checkpointing.checkpoint per forward)."
            )
    return section


def configure_activation_checkpointing(deepspeed: Any, config: dict[str, Any]) -> bool:
    """Hand the config's section to ``deepspeed.checkpointing.configure`` (if there is one); True if it was called."""
    section = config.get(SECTION)
    if not section:
        return False
    deepspeed.checkpointing.configure(
        mpu_=None,
        partition_activations=section.get("partition_activations"),
        contiguous_checkpointing=section.get("contiguous_memory_optimization"),
        num_checkpoints=section.get("number_checkpoints"),
        checkpoint_in_cpu=section.get("cpu_checkpointing"),
        synchronize=section.get("synchronize_checkpoint_boundary"),
        profile=section.get("profile"),
    )
    return True


__all__ = [
    "ARGUMENTS",
    "SECTION",
    "activation_settings",
    "configure_activation_checkpointing",
    "merge_activation_section",
]
