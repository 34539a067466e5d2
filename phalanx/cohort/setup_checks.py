"""What ``Cohort.setup`` checks before the strategy sees the module: Fabric's ``move_to_device=`` and the module
given alone to a strategy that needs its optimizer too (DeepSpeed)."""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from phalanx.strategies.strategy import Strategy


def check_optimizers_given(strategy: Strategy, optimizers: tuple[Any, ...]) -> None:
    """Refuse ``cohort.setup(module)`` without optimizers where the strategy builds one engine from both."""
    if optimizers or not strategy.traits.wraps_module_with_optimizers:
        return
    name = type(strategy).__name__
    raise ValueError(
        f"Cohort.setup(module) was given no optimizer, but {name} builds one engine from the module and its optimizer"
        " together, so it needs both in the same call. "
        "Pass the optimizer too: model, optimizer = cohort.setup(module, optimizer)."
    )


def check_placement(strategy: Strategy, module: nn.Module, move_to_device: Any, method: str) -> None:
    """Fabric's ``move_to_device=False``: accepted where the strategy's placement moves nothing (refused otherwise)."""
    if not isinstance(move_to_device, bool):
        raise TypeError(f"Cohort.{method}(move_to_device={move_to_device!r}) must be True or False.")
    if move_to_device:
        return
    target = strategy.root_device
    elsewhere = sorted(
        {
            str(tensor.device)
            for tensor in chain(module.parameters(), module.buffers())
            if tensor.device.type != "meta" and not _on(tensor.device, target)
        }
    )
    if elsewhere:
        raise ValueError(
            f"Cohort.{method}(move_to_device=False): the module has tensors on {elsewhere}, but"
            f" {type(strategy).__name__} places the module on {target} itself (every phalanx strategy does). "
            f"Move the module to {target} first (cohort.to_device(module)), or leave move_to_device=True."
        )


def _on(device: torch.device, target: torch.device) -> bool:
    return device.type == target.type and (target.index is None or device.index in (None, target.index))
