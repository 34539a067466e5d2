"""Turning ``configure_optimizers`` into optimizers and LR scheduler configurations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from phalanx.utilities.checks import is_int_at_least

if TYPE_CHECKING:
    from phalanx.module import TrainingModule

_VALID_FORMS = (
    "an optimizer; a list or tuple of optimizers; a tuple (list of optimizers, list of schedulers); a dict with"
    " 'optimizer' and optionally 'lr_scheduler' (a scheduler or a dict with 'scheduler', 'interval', 'frequency',"
    " 'monitor', 'strict', 'name') and 'monitor'; or a list of such dicts"
)
_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}


@dataclass
class LRSchedulerConfig:
    """A scheduler and when to step it."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    @property
    def reduce_on_plateau(self) -> bool:
        """Whether the scheduler steps on a monitored metric."""
        return isinstance(self.scheduler, ReduceLROnPlateau) or self.monitor is not None


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, Optimizer)


def _scheduler_config(value: Any, monitor: str | None) -> LRSchedulerConfig:
    if isinstance(value, Mapping):
        unknown = set(value) - _SCHEDULER_KEYS
        if unknown:
            raise ValueError(
                f"Unknown key(s) {sorted(unknown)} in an lr_scheduler dict; valid keys: {sorted(_SCHEDULER_KEYS)}."
            )
        if "scheduler" not in value:
            raise ValueError("An lr_scheduler dict needs a 'scheduler' key holding the scheduler.")
        config = LRSchedulerConfig(
            scheduler=value["scheduler"],
            interval=value.get("interval", "epoch"),
            frequency=value.get("frequency", 1),
            monitor=value.get("monitor", monitor),
            strict=value.get("strict", True),
            name=value.get("name"),
        )
    else:
        config = LRSchedulerConfig(scheduler=value, monitor=monitor)
    if not (hasattr(config.scheduler, "step") and hasattr(config.scheduler, "state_dict")):
        raise TypeError(
            f"configure_optimizers returned {type(config.scheduler).__name__} as a scheduler; a scheduler needs step()"
            " and state_dict()."
        )
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler interval={config.interval!r} is not valid; choose 'step' or 'epoch'.")
    if not is_int_at_least(config.frequency, 1):
        raise ValueError(f"lr_scheduler frequency={config.frequency!r} is not valid; it must be an int >= 1.")
    if isinstance(config.scheduler, ReduceLROnPlateau) and config.monitor is None:
        raise ValueError(
            "ReduceLROnPlateau needs a metric: return {'optimizer': opt, 'lr_scheduler': {'scheduler': sched,"
            " 'monitor': 'val_loss'}} from configure_optimizers."
        )
    return config


def parse_optimizers(returned: Any) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Normalise the value returned by ``configure_optimizers`` (see the valid forms in the error message)."""
    if _is_optimizer(returned):
        return [returned], []
    if isinstance(returned, Mapping):
        return _parse_dicts([returned])
    if isinstance(returned, Sequence) and not isinstance(returned, str) and returned:
        items = list(returned)
        if all(_is_optimizer(item) for item in items):
            return items, []
        if all(isinstance(item, Mapping) for item in items):
            return _parse_dicts(items)
        if len(items) == 2 and all(isinstance(part, Sequence) and not isinstance(part, str) for part in items):
            optimizers, schedulers = list(items[0]), list(items[1])
            if optimizers and all(_is_optimizer(o) for o in optimizers):
                return optimizers, [_scheduler_config(s, None) for s in schedulers]
    raise TypeError(
        f"configure_optimizers returned {_describe(returned)}, which phalanx cannot use. Return {_VALID_FORMS}."
    )


def _parse_dicts(dicts: list[Mapping[str, Any]]) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    optimizers: list[Optimizer] = []
    configs: list[LRSchedulerConfig] = []
    for entry in dicts:
        unknown = set(entry) - {"optimizer", "lr_scheduler", "monitor"}
        if unknown:
            raise ValueError(
                f"Unknown key(s) {sorted(unknown)} in the dict from configure_optimizers; valid keys: 'optimizer',"
                " 'lr_scheduler', 'monitor'."
            )
        optimizer = entry.get("optimizer")
        if not _is_optimizer(optimizer):
            raise TypeError(
                "The dict from configure_optimizers must hold a torch optimizer under 'optimizer', got"
                f" {_describe(optimizer)}."
            )
        optimizers.append(optimizer)
        if entry.get("lr_scheduler") is not None:
            configs.append(_scheduler_config(entry["lr_scheduler"], entry.get("monitor")))
    return optimizers, configs


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def init_optimizers_and_schedulers(module: TrainingModule) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Call ``configure_optimizers`` and check that each scheduler drives one of the returned optimizers."""
    optimizers, configs = parse_optimizers(module.configure_optimizers())
    for config in configs:
        scheduled = getattr(config.scheduler, "optimizer", None)
        if scheduled is not None and not any(scheduled is optimizer for optimizer in optimizers):
            raise ValueError(
                f"The scheduler {type(config.scheduler).__name__} drives an optimizer that configure_optimizers "
                f"did not return."
            )
    return optimizers, configs


def scheduler_states(configs: Sequence[LRSchedulerConfig]) -> list[dict[str, Any]]:
    """Each scheduler's ``state_dict()``, in the order ``configure_optimizers`` returned them."""
    return [config.scheduler.state_dict() for config in configs]


def load_scheduler_states(
    configs: Sequence[LRSchedulerConfig], states: Sequence[dict[str, Any]] | None, source: str
) -> None:
    """Load ``scheduler_states`` that ``source`` (a checkpoint, a peer replica group) holds into ``configs``'
    schedulers, after the optimizers' states (the learning rates then count from the saved step). None: ``source``
    holds none (a peer of an older phalanx), and the schedulers stay as they are."""
    if states is None:
        return
    if len(states) != len(configs):
        raise ValueError(
            f"{source} holds the states of {len(states)} learning-rate scheduler(s), but configure_optimizers made"
            f" {len(configs)}. Load them into a run that makes the same schedulers."
        )
    for config, state in zip(configs, states):
        config.scheduler.load_state_dict(state)
