"""Clear errors for strategies, accelerators and launchers written against the old contract that passed the Trainer."""

from __future__ import annotations

import inspect
from typing import Any

_NEW_SIGNATURES = {
    ("strategy", "setup"): "setup(self, settings: RunSettings) -> None",
    ("strategy", "setup_optimizers"): "setup_optimizers(self, settings: RunSettings) -> None",
    ("accelerator", "setup"): "setup(self) -> None",
    ("launcher", "launch"): "launch(self, function, *args, worker_state: WorkerState | None = None, **kwargs)",
}
_WHERE = {
    "strategy": "the run's stage, accumulation, clipping, batch size and optimizer factory are fields of settings"
    " (phalanx.strategies.RunSettings)",
    "accelerator": "it is called at the start of Strategy.setup and gets nothing",
    "launcher": "a launcher that starts processes carries state back through worker_state.collect()/restore()"
    " (phalanx.strategies.launchers.WorkerState)",
}


def refuse_trainer_parameters(strategy: Any) -> None:
    """Raise TypeError if ``strategy`` or its accelerator overrides a method with the old ``trainer`` parameter."""
    _check("strategy", strategy, "setup")
    _check("strategy", strategy, "setup_optimizers")
    if getattr(strategy, "accelerator", None) is not None:
        _check("accelerator", strategy.accelerator, "setup")


def refuse_trainer_launcher(launcher: Any) -> None:
    """Raise TypeError if ``launcher.launch`` still takes the old ``trainer`` keyword."""
    _check("launcher", launcher, "launch")


def _check(kind: str, obj: Any, name: str) -> None:
    method = getattr(type(obj), name, None)
    if method is None:
        return
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or an object inspect cannot read: nothing to say
        return
    if "trainer" in parameters:
        owner = type(obj).__qualname__
        raise TypeError(
            f"{owner}.{name} takes a `trainer` argument, but {kind}s no longer receive the Trainer. Define"
            f" {owner}.{_NEW_SIGNATURES[(kind, name)]} instead: {_WHERE[kind]}."
        )


__all__ = ["refuse_trainer_launcher", "refuse_trainer_parameters"]
