"""What the Cohort checks before the strategy sees its arguments (Fabric's ``move_to_device=``, the module given alone
to a strategy that needs its optimizer too, the optimizers' and paths' types), and how it rebinds the optimizers."""

from __future__ import annotations

from itertools import chain
from os import PathLike
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.cohort.wrappers import unwrap_optimizer
from phalanx.strategies.strategy import Strategy


def check_cohort_offered(strategy: Strategy) -> None:
    """Refuse a strategy whose traits say that the Cohort cannot drive it (``cohort_unsupported``), with the reason."""
    reason = strategy.traits.cohort_unsupported
    if reason is not None:
        raise ValueError(f"The Cohort cannot drive {type(strategy).__name__}: {reason}")


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


def check_optimizer(optimizer: Any, index: int) -> Optimizer:
    """``optimizers[index]`` of ``Cohort.setup`` as a plain torch optimizer, or the reason it is not one."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"Cohort.setup: optimizers[{index}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    if unwrap_optimizer(optimizer) is not optimizer:
        raise ValueError(f"Cohort.setup: optimizers[{index}] was already set up by a Cohort; pass the plain optimizer.")
    return optimizer


def check_path(path: Any, method: str) -> None:
    if not isinstance(path, (str, PathLike)):
        raise TypeError(f"Cohort.{method}(path, state): path must be a str or os.PathLike, got {type(path).__name__}.")


def is_training_module(module: nn.Module) -> bool:
    # Lazy for import time: `from phalanx import Cohort` does not load the TrainingModule.
    from phalanx.module import TrainingModule

    return isinstance(module, TrainingModule)


def _on(device: torch.device, target: torch.device) -> bool:
    return device.type == target.type and (target.index is None or device.index in (None, target.index))


def check_parameters_known(optimizer: Optimizer, index: int, names: dict[int, str]) -> None:
    """Refuse an optimizer holding a parameter that is not one of the module's (``names``: by ``id``)."""
    for group_index, group in enumerate(optimizer.param_groups):
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise ValueError(
                    f"Cohort.setup: optimizers[{index}].param_groups[{group_index}] holds a parameter (shape"
                    f" {list(parameter.shape)}) that is"
                    " not a parameter of the module being set up; build the optimizer from module.parameters()."
                )


def rebind(
    optimizer: Optimizer, set_up: nn.Module, names: dict[int, str], removed: set[str], strategy: Strategy
) -> None:
    """Point ``optimizer`` at ``set_up``'s parameters of the same names (the same objects unless the strategy
    replaced them); parameters named in ``removed`` (another pipeline stage's) are dropped."""
    by_name = dict(set_up.named_parameters(remove_duplicate=False))
    replaced: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups:
        new_params = []
        for parameter in group["params"]:
            name = names.get(id(parameter), "")
            if name in removed:  # configure_model removed it (another pipeline stage's)
                optimizer.state.pop(parameter, None)
                continue
            new = by_name.get(name, parameter)
            replaced[parameter] = new
            new_params.append(new)
        group["params"] = new_params
    if any(old is not new for old, new in replaced.items()) and any(optimizer.state.values()):
        # Saved per-parameter state (momentum, ...) has the whole parameter's shape, the new parameters are shards.
        raise ValueError(
            f"Cohort.setup: {type(strategy).__name__} replaces the module's parameters, "
            f"but the {type(optimizer).__name__} already holds per-parameter state; "
            "set up an optimizer that has not stepped yet, and load its state with cohort.load."
        )
