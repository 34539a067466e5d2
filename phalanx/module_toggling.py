"""Optimizer toggling for ``TrainingModule``: while one optimizer steps, the parameters only the others own stop
requiring gradients, and get their ``requires_grad`` back afterwards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn


def parameters_of(optimizer: Any) -> Iterator[nn.Parameter]:
    """The parameters of every group of ``optimizer``."""
    for group in optimizer.param_groups:
        yield from group["params"]


def toggle_requires_grad(optimizers: Sequence[Any], optimizer: Any) -> dict[nn.Parameter, bool]:
    """Let only ``optimizer``'s parameters require gradients; return what the others' ``requires_grad`` was."""
    state: dict[nn.Parameter, bool] = {}
    for other in optimizers:
        for parameter in parameters_of(other):
            if parameter not in state:
                state[parameter] = parameter.requires_grad
                parameter.requires_grad = False
    for parameter in parameters_of(optimizer):
        # A parameter frozen before stays frozen: only what was switched off above is switched back on.
        parameter.requires_grad = state.get(parameter, parameter.requires_grad)
    return state


def untoggle_requires_grad(optimizers: Sequence[Any], optimizer: Any, state: dict[nn.Parameter, bool]) -> None:
    """Give the parameters of ``optimizers`` other than ``optimizer`` their ``requires_grad`` from ``state`` back."""
    for other in optimizers:
        if other is optimizer or other is getattr(optimizer, "optimizer", None):
            continue  # the toggled one (or the handle from self.optimizers() wrapping it)
        for parameter in parameters_of(other):
            if parameter in state:
                parameter.requires_grad = state[parameter]


__all__ = ["parameters_of", "toggle_requires_grad", "untoggle_requires_grad"]
