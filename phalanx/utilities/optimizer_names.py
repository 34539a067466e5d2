"""Optimizer states keyed by parameter name rather than position, so that a checkpoint written by ranks holding
different parts of a model (pipeline stages) loads into any other split of the same model."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
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


def order_keys(module: nn.Module) -> dict[str, tuple[tuple[int, int], ...]]:
    """For each parameter of ``module`` (as ``named_parameters`` lists it), a key that sorts the parameters of the
    whole model in ``named_parameters`` order, when ``module`` holds only some of them.

    The keys of several ranks' modules sort together as the whole model's parameters: a block of a numbered
    container (``nn.ModuleList``, ``nn.Sequential``) is placed by its number, which stays when other blocks are
    removed; any other submodule by its place among its parent's children, which stays when it is set to None.
    """
    keys: dict[str, tuple[tuple[int, int], ...]] = {}
    seen: set[int] = set()

    def visit(node: nn.Module, prefix: str, path: tuple[tuple[int, int], ...]) -> None:
        for index, (name, parameter) in enumerate(node._parameters.items()):
            if parameter is not None and id(parameter) not in seen:  # a shared one keeps its first name
                seen.add(id(parameter))
                keys[prefix + name] = (*path, (0, index))  # a module's own parameters come before its children's
        for index, (name, child) in enumerate(node._modules.items()):
            if child is not None:
                visit(child, f"{prefix}{name}.", (*path, (1, int(name) if name.isdigit() else index)))

    visit(module, "", ())
    return keys


def groups_in_order(parts: list[list[list[tuple[str, Any]]]]) -> list[list[str]]:
    """Each parameter group's names over several ranks' ``parts`` (per group, (name, ``order_keys`` key) pairs), in
    the whole model's order; a name listed by several ranks (data-parallel replicas of a stage) counts once."""
    merged: list[dict[str, Any]] = [{} for _ in parts[0]] if parts else []
    for part in parts:
        for found, group in zip(merged, part):
            found.update(group)
    return [sorted(found, key=found.__getitem__) for found in merged]


def name_positions(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """A state keyed by position, written for the whole model, keyed by name instead: ``group_names`` lists each
    parameter group's parameters of the whole model in the order the optimizer held them."""
    groups = state["param_groups"]
    sizes = [len(group["params"]) for group in groups]
    if sizes != [len(names) for names in group_names]:
        raise ValueError(
            f"The checkpoint's optimizer state has parameter groups of {sizes} parameters but the model's groups hold"
            f" {[len(names) for names in group_names]}; resume with the same model and configure_optimizers."
        )
    by_position = {pid: name for group, names in zip(groups, group_names) for pid, name in zip(group["params"], names)}
    return {
        "state": {by_position[pid]: entries for pid, entries in state["state"].items() if pid in by_position},
        "param_groups": [{**group, "params": names} for group, names in zip(groups, group_names)],
    }


def check_state_shapes(optimizer: Optimizer, module: nn.Module, state: dict[str, Any]) -> None:
    """Refuse a state keyed by name whose per-parameter tensors (moments, momentum) are not shaped like the
    parameter of that name: the positions were named in another order than the optimizer's."""
    names = _names(module)
    for parameter in (p for group in optimizer.param_groups for p in group["params"]):
        name = names.get(id(parameter))
        for entry, value in state["state"].get(name, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.numel() != parameter.numel():
                raise ValueError(
                    f"The checkpoint's optimizer state {entry!r} for parameter {name!r} has {value.numel()} values,"
                    f" but the parameter has {parameter.numel()}: a state keyed by position is named here by the"
                    " module's parameter order. List the parameters in each group in the module's order (as"
                    " self.parameters() does) to resume it under a pipeline."
                )
