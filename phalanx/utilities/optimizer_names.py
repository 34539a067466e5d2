"""Optimizer states keyed by parameter name rather than position, so that a checkpoint written by ranks holding
different parts of a model (pipeline stages) loads into any other split of the same model."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer


def _names(module: nn.Module) -> dict[int, str]:
    # Shared parameters appear once in named_parameters (the first name), as in the optimizer's groups.
    return {id(parameter): name for name, parameter in module.named_parameters()}


def is_keyed_by_name(state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (strings) instead of numbering them."""
    return any(isinstance(pid, str) for group in state.get("param_groups", []) for pid in group.get("params", []))


def state_by_name(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each parameter's position replaced by its name in ``module``."""
    names = _names(module)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    unnamed = [index for index, p in enumerate(parameters) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"The optimizer holds parameters at positions {unnamed} that are not parameters of"
            f" {type(module).__name__}; optimize only the module's parameters to save a checkpoint keyed by name."
        )
    state = optimizer.state_dict()
    by_position = {index: names[id(p)] for index, p in enumerate(parameters)}
    return {
        "state": {by_position[pid]: entries for pid, entries in state["state"].items()},
        "param_groups": [
            {**group, "params": [by_position[pid] for pid in group["params"]]} for group in state["param_groups"]
        ],
    }


def state_by_position(optimizer: Optimizer, module: nn.Module | None, state: dict[str, Any]) -> dict[str, Any]:
    """A state keyed by name (possibly covering more parameters than this rank holds) as ``optimizer`` numbers its
    parameters; a state keyed by position (or without a module to name the parameters) is returned as it is."""
    if module is None or not is_keyed_by_name(state):
        return state
    names = _names(module)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer state has {len(saved_groups)} parameter group(s) but the optimizer has"
            f" {len(optimizer.param_groups)}; resume with the same configure_optimizers."
        )
    position = 0
    groups, converted = [], {}
    for saved, live in zip(saved_groups, optimizer.param_groups):
        known = set(saved["params"])
        missing = [names.get(id(p), "?") for p in live["params"] if names.get(id(p)) not in known]
        if missing:
            raise ValueError(
                f"The checkpoint's optimizer state has no entry for the parameters {missing}; resume with the same"
                " model and configure_optimizers."
            )
        ids = []
        for parameter in live["params"]:
            name = names[id(parameter)]
            if name in state["state"]:
                converted[position] = state["state"][name]
            ids.append(position)
            position += 1
        groups.append({**saved, "params": ids})
    return {"state": converted, "param_groups": groups}
