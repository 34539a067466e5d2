"""Resuming DeepSpeed training from a checkpoint of another layout: one file, a sharded (DCP) directory, or a DeepSpeed
directory of another ZeRO stage or world size.

Every such checkpoint is first read whole (full weights, and the optimizer state in torch's ``state_dict`` layout: a
DeepSpeed directory is consolidated, see :mod:`phalanx.plugins.io.formats.deepspeed`). The weights go into the
module; the optimizer state goes into the engine through DeepSpeed's public tensor-fragment API
(``deepspeed.utils.safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``), each rank keeping its own
partition of the float32 master weights and of every per-element state tensor. Conversion never resumes partly: a
checkpoint without an optimizer state, or one whose state cannot be laid out on the engine, raises a
``CheckpointError`` that names both layouts and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from phalanx.utilities.exceptions import CheckpointError


def source_layout(path: Any, meta: dict[str, Any] | None = None) -> str:
    """How the checkpoint at ``path`` is laid out, in words (for error messages)."""
    if isinstance(meta, dict) and "directory" in meta:
        return deepspeed_layout(meta.get("zero_stage"), meta.get("world_size"))
    if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
        return "a sharded (DCP) checkpoint directory"
    return "a single-file checkpoint"


def deepspeed_layout(zero_stage: Any, world_size: Any) -> str:
    """A DeepSpeed checkpoint directory's layout, in words."""
    written = f" written by {world_size} processes" if world_size is not None else ""
    return f"a DeepSpeed ZeRO stage {zero_stage} directory{written}"


def conversion_error(source: str, path: Any, target: str, problem: str, remedy: str) -> CheckpointError:
    """The error for a conversion that cannot be done: the checkpoint, both layouts, the problem and what to do."""
    return CheckpointError(f"Cannot resume {target} from {source} ({path}): {problem}. {remedy}")


WEIGHTS_ONLY_REMEDY = (
    "To start a new run from its weights only, consolidate it (phalanx checkpoint consolidate), load the weights"
    " (TrainingModule.load_from_checkpoint) and call fit without ckpt_path"
)


def single_optimizer_state(states: Any, *, source: str, path: Any, target: str, optimizers: int) -> dict[str, Any]:
    """The one optimizer state in torch's layout that the engine's optimizer takes, or a conversion error."""
    if not isinstance(states, list) or not states:
        raise conversion_error(
            source, path, target, "the checkpoint holds no optimizer state (it was saved weights-only, or DeepSpeed's"
            " optimizer partitions could not be mapped to torch's layout)", WEIGHTS_ONLY_REMEDY,
        )  # fmt: skip
    if len(states) != optimizers:
        raise conversion_error(
            source, path, target, f"it holds {len(states)} optimizer states and DeepSpeed drives {optimizers}",
            "Resume with the same configure_optimizers",
        )  # fmt: skip
    state = states[0]
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        raise conversion_error(
            source, path, target, "its optimizer state is not in torch's optimizer.state_dict() layout",
            WEIGHTS_ONLY_REMEDY,
        )  # fmt: skip
    return state


def target_groups(zero_optimizer: Any, zero_stage: int) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Per parameter group of the user's optimizer: its trainable parameters in order, and the flat float32
    partitions (this rank's) that hold their master weights and optimizer state."""
    if zero_stage in (1, 2):
        groups = [list(group) for group in zero_optimizer.bit16_groups]
        flats = [[flat] for flat in zero_optimizer.single_partition_of_fp32_groups]
        return groups, flats
    owner = zero_optimizer.sub_group_to_group_id
    count = len(zero_optimizer.optimizer.param_groups)
    groups = [[] for _ in range(count)]
    flats = [[] for _ in range(count)]
    for sub, parameters in enumerate(zero_optimizer.fp16_groups):
        groups[owner[sub]].extend(parameters)
        flats[owner[sub]].append(zero_optimizer.fp32_partitioned_groups_flat[sub])
    return groups, flats


def _numel(parameter: Tensor) -> int:
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def split_group_state(
    saved: dict[str, Any], groups: list[list[Tensor]], *, source: str, path: Any, target: str
) -> list[tuple[dict[str, Any], list[dict[str, Tensor]], dict[str, Any]]]:
    """Per group: its hyper-parameters, each parameter's per-element state tensors, and the group's shared scalars.

    Refused (conversion error) where the saved groups do not match the engine's, or where parameters of one group
    carry different scalars (DeepSpeed keeps one state per flat partition, so they must agree, e.g. Adam's ``step``).
    """
    saved_groups = saved["param_groups"]
    shape = [len(group) for group in groups]
    saved_shape = [len(group.get("params", [])) for group in saved_groups]
    if shape != saved_shape:
        raise conversion_error(
            source, path, target, f"its optimizer has parameter groups of {saved_shape} parameters and the "
                                  f"engine's {shape}", "Resume with the same model and configure_optimizers",
        )  # fmt: skip
    result = []
    for group_index, (saved_group, parameters) in enumerate(zip(saved_groups, groups)):
        per_element: list[dict[str, Tensor]] = []
        scalars: dict[str, Any] = {}
        for pid, parameter in zip(saved_group["params"], parameters):
            entry = saved["state"].get(pid)
            if not entry:
                raise conversion_error(
                    source, path, target, f"parameter {pid} of group {group_index} has no optimizer state "
                                          f"(it never stepped)", WEIGHTS_ONLY_REMEDY,
                )  # fmt: skip
            tensors = {}
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if value.numel() != _numel(parameter):
                        raise conversion_error(
                            source, path, target, f"the optimizer state {key!r} of parameter {pid} has"
                            f" {value.numel()} elements and the parameter {_numel(parameter)}",
                            "Resume with the same model",
                        )  # fmt: skip
                    tensors[key] = value
                elif _same_scalar(scalars.setdefault(key, value), value):
                    continue
                else:
                    raise conversion_error(
                        source, path, target, f"the parameters of group {group_index} have different {key!r}"
                        " values, and DeepSpeed keeps one per group",
                        "Resume on a strategy that keeps a state per parameter (ddp, fsdp)",
                    )  # fmt: skip
            per_element.append(tensors)
        hyper = {key: value for key, value in saved_group.items() if key != "params"}
        result.append((hyper, per_element, scalars))
    return result


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return bool(torch.as_tensor(a).float().eq(torch.as_tensor(b).float()).all())
    return a == b


def load_into_zero_optimizer(
    zero_optimizer: Any,
    zero_stage: int,
    weights: dict[str, Tensor],
    names: dict[int, str],
    saved: dict[str, Any],
    *,
    source: str,
    path: Any,
    target: str,
) -> None:
    """Write full weights and a torch-layout optimizer state into a ZeRO optimizer's partitions on this rank."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    groups, flats = target_groups(zero_optimizer, zero_stage)
    base = zero_optimizer.optimizer
    split = split_group_state(saved, groups, source=source, path=path, target=target)
    if len(base.param_groups) != len(split):
        raise conversion_error(
            source, path, target, f"the engine's optimizer has {len(base.param_groups)} parameter groups and the"
            f" checkpoint's {len(split)}", "Resume with the same configure_optimizers",
        )  # fmt: skip
    for group_index, (hyper, per_element, scalars) in enumerate(split):
        keys = set().union(*(entry.keys() for entry in per_element)) if per_element else set()
        for flat in flats[group_index]:
            # The state the optimizer would create on its first step, with the saved scalars (Adam's step).
            state = {key: torch.zeros_like(flat) for key in keys}
            state.update({key: value.clone() if isinstance(value, Tensor) else value for key, value in scalars.items()})
            base.state[flat] = state
        if zero_stage in (1, 2):
            lazy_init_hp_params_optimizer_state(groups[group_index], flats[group_index][0], base.state)
        base.param_groups[group_index].update(hyper)
        for parameter, entry in zip(groups[group_index], per_element):
            name = names[id(parameter)]
            if name not in weights:
                raise conversion_error(
                    source, path, target, f"it holds no weights for parameter {name!r}", "Resume with the same model"
                )
            if zero_stage == 3:
                _set_zero3_partition(zero_optimizer, parameter, weights[name], None)
                for key, value in entry.items():
                    _set_zero3_partition(zero_optimizer, parameter, value, key)
                continue
            safe_set_full_fp32_param(parameter, weights[name].float())
            for key, value in entry.items():
                safe_set_full_optimizer_state(parameter, value.float(), key)
    if zero_stage in (1, 2):
        zero_optimizer._hp_optimizer_states_linked = True  # linked above; DeepSpeed would link again on its step


def _set_zero3_partition(zero_optimizer: Any, parameter: Tensor, value: Tensor, key: str | None) -> None:
    """This rank's part of a whole tensor into a ZeRO-3 float32 partition (master weights, or state ``key``).

    DeepSpeed's ``safe_set_full_*`` cuts the part from the unpadded tensor, which fails on the last rank when the
    parameter does not divide evenly; here the part beyond the tensor's end (DeepSpeed's padding) is zero.
    """
    if not parameter.requires_grad:
        return
    partition, _ = zero_optimizer._get_fp32_opt_state_partition(
        parameter, release_swap_buffers=False, optim_state_key=key
    )
    size = partition.numel()
    start = size * zero_optimizer._get_param_partition_rank(parameter)
    piece = value.detach().reshape(-1)[start : start + size]
    partition.data.zero_()
    partition.data[: piece.numel()].copy_(piece.to(partition.dtype))


__all__ = [
    "WEIGHTS_ONLY_REMEDY",
    "conversion_error",
    "deepspeed_layout",
    "load_into_zero_optimizer",
    "single_optimizer_state",
    "source_layout",
    "split_group_state",
    "target_groups",
]
