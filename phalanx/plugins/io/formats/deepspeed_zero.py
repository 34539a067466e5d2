"""Merging the ZeRO partitions of a DeepSpeed checkpoint back into whole tensors and torch's optimizer layout.

Each rank of a ZeRO run saved its part of the float32 master weights and of the optimizer state: stages 1 and 2 cut
each parameter group's flat vector evenly across ranks, stage 3 cuts every parameter on its own. Everything built
here is counted against the bytes the files hold (``bounded_reads``), and a partition that does not fit the shapes
the module file records is a ``CheckpointError`` naming the parameter. The optimizer state is mapped only for
optimizers with one state value per parameter element plus scalars; otherwise these return None for it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from torch import Tensor

from phalanx.plugins.io.bounded_reads import counted_cat, counted_clone, counted_flat, counted_float
from phalanx.utilities.exceptions import CheckpointError


def zero12(
    param_shapes: list[OrderedDict[str, Any]], optim_states: list[dict[str, Any]], source: str
) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """ZeRO stages 1 and 2: each param group is one flat vector split evenly across ranks (padding at the end)."""
    trainable, slices = _zero12_weights(param_shapes, optim_states, source)
    return trainable, _zero12_optimizer(param_shapes, optim_states, slices)


_Slices = list[list[tuple[str, int, int, Any]]]  # per param group: (name, offset, numel, shape) of each parameter


def _zero12_weights(
    param_shapes: list[OrderedDict[str, Any]], optim_states: list[dict[str, Any]], source: str
) -> tuple[dict[str, Tensor], _Slices]:
    """The float32 master weights by parameter name, and where each parameter lies in its group's flat vector."""
    paddings = optim_states[0].get("param_alignment_paddings")
    trainable: dict[str, Tensor] = {}
    slices: _Slices = []
    for group, shapes in enumerate(param_shapes):
        sizes = [state["single_partition_of_fp32_groups"][group].numel() for state in optim_states]
        # DeepSpeed splits a group evenly; only the last rank's part is saved shorter (without its padding).
        if any(size != sizes[0] for size in sizes[:-1]) or sizes[-1] > sizes[0]:
            raise CheckpointError(
                f"{source}: the optimizer partitions of parameter group {group} hold {sizes} elements; DeepSpeed"
                " splits a group evenly, so they come from different checkpoints."
            )
        flat = counted_cat([counted_float(state["single_partition_of_fp32_groups"][group]) for state in optim_states])
        offset = 0
        group_slices = []
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(
                    f"{source}: parameter {name!r} lies beyond the saved partitions of group {group}; the checkpoint"
                    " is incomplete, or its files come from different checkpoints."
                )
            trainable[name] = counted_clone(flat[offset : offset + numel].view(shape))
            group_slices.append((name, offset, numel, shape))
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        slices.append(group_slices)
    return trainable, slices


def _zero12_optimizer(
    param_shapes: list[OrderedDict[str, Any]], optim_states: list[dict[str, Any]], slices: _Slices
) -> dict[str, Any] | None:
    """The optimizer state in torch's layout, or None where it cannot be mapped (see the module docstring)."""
    bases = [state["base_optimizer_state"] for state in optim_states]
    per_group_states: list[Any] = [_group_states_12(base, len(param_shapes)) for base in bases]
    if any(states is None for states in per_group_states):
        return None
    hyper = _group_hyper_parameters(bases[0], len(param_shapes))
    if hyper is None:
        return None
    # The master weights were saved without the padding at the end of the last rank's partition; the state was not.
    partition_numels = [
        [state["single_partition_of_fp32_groups"][g].numel() for g in range(len(param_shapes))]
        for state in optim_states
    ]
    paddings_per_rank = [list(state.get("group_paddings") or [0] * len(param_shapes)) for state in optim_states]
    state_out: dict[int, dict[str, Any]] = {}
    groups_out: list[dict[str, Any]] = []
    next_index = 0
    for group, group_slices in enumerate(slices):
        keys = per_group_states[0][group].keys()
        full: dict[str, Any] = {}
        for key in keys:
            values = [states[group].get(key) for states in per_group_states]
            merged = _merge_state_value(
                values, [numels[group] for numels in partition_numels], [pads[group] for pads in paddings_per_rank]
            )
            if merged is _UNMAPPABLE:
                return None
            full[key] = merged
        indices = []
        for _name, offset, numel, shape in group_slices:
            entry = {}
            for key, value in full.items():
                entry[key] = (
                    counted_clone(value[offset : offset + numel].view(shape))
                    if isinstance(value, _Flat)
                    else _copy(value.value)
                )
            if entry:
                state_out[next_index] = entry
            indices.append(next_index)
            next_index += 1
        groups_out.append({**hyper[group], "params": indices})
    return {"state": state_out, "param_groups": groups_out}


def _group_states_12(base: Any, groups: int) -> list[dict[str, Any]] | None:
    """Per param group, the state of its one flat parameter (both layouts DeepSpeed writes)."""
    if isinstance(base, list) and len(base) == groups and all(isinstance(s, dict) for s in base):
        return base  # "elastic" layout: one lean state dict per group
    if isinstance(base, dict) and "state" in base and "param_groups" in base and len(base["param_groups"]) == groups:
        result = []
        for group in base["param_groups"]:
            params = group.get("params", [])
            if len(params) != 1:
                return None
            result.append(base["state"].get(params[0], {}))
        return result
    return None


def _group_hyper_parameters(base: Any, groups: int) -> list[dict[str, Any]] | None:
    if isinstance(base, dict) and len(base.get("param_groups", [])) == groups:
        return [{key: value for key, value in group.items() if key != "params"} for group in base["param_groups"]]
    return None


class _Flat:
    """A state tensor with one value per element of the flat parameter vector."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, item: slice) -> Tensor:
        return self.tensor[item]


class _Scalar:
    """A state value shared by every parameter of the group (e.g. Adam's ``step``)."""

    def __init__(self, value: Any) -> None:
        self.value = value


_UNMAPPABLE = object()


def _merge_state_value(values: list[Any], partition_numels: list[int], paddings: list[int]) -> Any:
    if any(value is None for value in values):
        return _UNMAPPABLE
    first = values[0]
    if isinstance(first, Tensor) and first.dim() > 0:
        if all(
            isinstance(v, Tensor) and v.numel() in (n, n + pad) for v, n, pad in zip(values, partition_numels, paddings)
        ):
            return _Flat(counted_cat([counted_flat(v)[:n] for v, n in zip(values, partition_numels)]))
        return _UNMAPPABLE
    if isinstance(first, (Tensor, int, float, bool)):
        return _Scalar(first)
    return _UNMAPPABLE


def _copy(value: Any) -> Any:
    return counted_clone(value) if isinstance(value, Tensor) else value


def zero3(
    param_shapes: list[OrderedDict[str, Any]], optim_states: list[dict[str, Any]], world_size: int, source: str
) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """ZeRO stage 3: every parameter is split on its own into ``ceil(numel / world_size)`` elements per rank."""
    flats = [counted_cat([counted_float(group) for group in state["fp32_flat_groups"]]) for state in optim_states]
    if any(flat.numel() != flats[0].numel() for flat in flats):
        raise CheckpointError(
            f"{source}: the optimizer partitions hold {[flat.numel() for flat in flats]} elements; ZeRO-3 gives every"
            " rank as many, so they come from different checkpoints."
        )
    layout: list[tuple[int, str, int, int, Any]] = []  # (group, name, offset in each rank's flat vector, numel, shape)
    offset = 0
    trainable: dict[str, Tensor] = {}
    for group, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            if offset + part > flats[0].numel():
                raise CheckpointError(
                    f"{source}: parameter {name!r} lies beyond the saved partitions; the checkpoint is incomplete, or"
                    " its files come from different checkpoints."
                )
            trainable[name] = counted_clone(
                counted_cat([flat[offset : offset + part] for flat in flats])[:numel].view(shape)
            )
            layout.append((group, name, offset, numel, shape))
            offset += part
    optimizer = _zero3_optimizer(param_shapes, optim_states, layout, world_size)
    return trainable, optimizer


def _zero3_optimizer(
    param_shapes: list[OrderedDict[str, Any]],
    optim_states: list[dict[str, Any]],
    layout: list[tuple[int, str, int, int, Any]],
    world_size: int,
) -> dict[str, Any] | None:
    bases: list[Any] = [state.get("optimizer_state_dict") for state in optim_states]
    if not all(isinstance(base, dict) and "state" in base and "param_groups" in base for base in bases):
        return None
    sub_numels = [group.numel() for group in optim_states[0]["fp32_flat_groups"]]
    sub_groups = bases[0]["param_groups"]
    if len(sub_groups) != len(sub_numels):
        return None
    owner_group = _zero3_owner_groups(param_shapes, sub_numels, world_size)
    if owner_group is None:
        return None
    merged = _zero3_merged_state(bases, sub_numels)
    if merged is None:
        return None
    state_out: dict[int, dict[str, Any]] = {}
    indices_per_group: list[list[int]] = [[] for _ in param_shapes]
    for index, (group, _name, offset, numel, shape) in enumerate(layout):
        part = math.ceil(numel / world_size)
        entry = {}
        for key, value in merged.items():
            if isinstance(value, list):
                entry[key] = counted_clone(
                    counted_cat([flat[offset : offset + part] for flat in value])[:numel].view(shape)
                )
            else:
                entry[key] = _copy(value)
        if entry:
            state_out[index] = entry
        indices_per_group[group].append(index)
    groups_out = []
    for group in range(len(param_shapes)):
        first_sub = owner_group.index(group) if group in owner_group else None
        hyper = (
            {key: value for key, value in sub_groups[first_sub].items() if key != "params"}
            if first_sub is not None
            else {}
        )
        groups_out.append({**hyper, "params": indices_per_group[group]})
    return {"state": state_out, "param_groups": groups_out}


def _zero3_owner_groups(
    param_shapes: list[OrderedDict[str, Any]], sub_numels: list[int], world_size: int
) -> list[int] | None:
    """The param group of each sub-group, or None when the sub-groups do not tile the groups."""
    # Each sub-group (DeepSpeed splits big param groups by sub_group_size) belongs to one param group.
    group_totals = [
        sum(math.ceil(math.prod(shape) / world_size) for shape in shapes.values()) for shapes in param_shapes
    ]
    owner_group: list[int] = []
    group, filled = 0, 0
    for numel in sub_numels:
        while group < len(group_totals) and filled == group_totals[group]:
            group, filled = group + 1, 0
        if group >= len(group_totals) or filled + numel > group_totals[group]:
            return None
        owner_group.append(group)
        filled += numel
    return owner_group


def _zero3_merged_state(bases: list[dict[str, Any]], sub_numels: list[int]) -> dict[str, Any] | None:
    """Per state key: each rank's flat vector (a list, one per rank) or the shared scalar; None when unmappable."""
    merged: dict[str, Any] = {}
    keys = None
    for base in bases:
        per_sub = []
        for sub in base["param_groups"]:
            params = sub.get("params", [])
            if len(params) != 1:
                return None
            per_sub.append(base["state"].get(params[0], {}))
        if keys is None:
            keys = list(per_sub[0].keys())
        for key in keys:
            pieces = [entry.get(key) for entry in per_sub]
            if any(piece is None for piece in pieces):
                return None
            if isinstance(pieces[0], Tensor) and pieces[0].dim() > 0:
                if not all(isinstance(p, Tensor) and p.numel() == n for p, n in zip(pieces, sub_numels)):
                    return None
                merged.setdefault(key, []).append(counted_cat(pieces))
            elif isinstance(pieces[0], (Tensor, int, float, bool)):
                merged.setdefault(key, pieces[0])
            else:
                return None
    return merged


def zero3_frozen(model_states: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Parameters outside the optimizer under ZeRO-3: each rank saved its shard of each."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    frozen = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        pieces = [state["frozen_param_fragments"][name] for state in model_states]
        frozen[name] = counted_clone(counted_cat(pieces)[:numel].view(shape))
    return frozen
