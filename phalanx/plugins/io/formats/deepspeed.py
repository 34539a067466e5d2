"""DeepSpeed checkpoint directories written by ``DeepSpeedStrategy``, and turning one into a phalanx checkpoint.

Layout of ``NAME.ckpt/``::

    latest                          DeepSpeed's pointer to the tag directory ('checkpoint')
    checkpoint/                     DeepSpeed's own files: every rank writes its ZeRO partitions
        mp_rank_00_model_states.pt                   stages 0-2: the module (in the training dtype), parameter shapes
        zero_pp_rank_R_mp_rank_00_model_states.pt    stage 3: buffers, shapes, frozen-parameter shards of rank R
        [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   stages 1-3: rank R's float32 weights and optimizer state
    phalanx_deepspeed_state.pt     the Trainer's state (loops, callbacks, RNG states, schedulers...): plain values
    .complete                       written last, once every rank has finished

Consolidation never imports deepspeed and never unpickles arbitrary objects: DeepSpeed's files are read with
``torch.load(weights_only=True)``, with a short allow-list, active only while phalanx reads one of these files, that
maps the few DeepSpeed record types they contain (loss scaler, ZeRO stage enum, fragment addresses) to inert
placeholder objects. The tag must be a plain name inside the directory, no file read may lead outside it through a
symbolic link, and what is built is bounded by the bytes the files hold. A file that is missing, truncated, damaged or
from another checkpoint gives one ``CheckpointError`` naming it.

The optimizer state is mapped back to the standard ``optimizer.state_dict()`` layout (one entry per parameter, numbered
in parameter-group order) for optimizers whose state tensors have one value per parameter element (Adam, AdamW, SGD
with momentum, ...) plus scalars such as ``step``. When that is impossible (other state layouts, optimizer state
offloaded to NVMe), the consolidated checkpoint holds the weights and training progress but no ``optimizer_states``:
it can be loaded as weights (``load_from_checkpoint``) but training cannot resume from it.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from phalanx.plugins.io.bounded_reads import (
    allocation_budget,
    check_tensors,
    counted_cat,
    counted_clone,
    counted_flat,
    counted_float,
    open_checkpoint_file,
)
from phalanx.plugins.io.checkpoint_files import OPTIMIZER_OMITTED, entry_inside
from phalanx.plugins.io.formats.deepspeed_files import Files, load_part, tag_directory
from phalanx.plugins.io.torch_io import load_bytes
from phalanx.utilities.exceptions import CheckpointError

#: The key of a consolidated checkpoint that holds DeepSpeed's engine counters (``global_steps``, ``global_samples``).
ENGINE_STEPS = "deepspeed_engine_steps"

#: Reads one file of the checkpoint: ``read(path, map_location)`` (a CheckpointIO's ``load_checkpoint``).
Reader = Callable[[Path, Any], dict[str, Any]]

#: The Trainer's own state in a DeepSpeed checkpoint directory.
STATE_FILE = "phalanx_deepspeed_state.pt"
#: The tag (sub-directory) DeepSpeedStrategy saves DeepSpeed's files under.
TAG = "checkpoint"
#: What ``DeepSpeedStrategy.optimizer_state`` puts in a checkpoint in place of each optimizer's state.
OPTIMIZER_MARKER_KEY = "stored_by"
OPTIMIZER_MARKER = {OPTIMIZER_MARKER_KEY: "deepspeed"}


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory written by ``DeepSpeedStrategy`` (reading a file refuses a FIFO)."""
    directory = Path(path)
    return directory.is_dir() and all(os.path.lexists(directory / name) for name in (STATE_FILE, "latest"))


def is_optimizer_marker(state: Any) -> bool:
    """Whether ``state`` is the placeholder that says DeepSpeed's files hold this optimizer's state."""
    return isinstance(state, dict) and state.get(OPTIMIZER_MARKER_KEY) == OPTIMIZER_MARKER[OPTIMIZER_MARKER_KEY]


def read_trainer_state(path: str | os.PathLike, *, read: Reader | None = None) -> dict[str, Any]:
    """The Trainer's state saved beside DeepSpeed's files (``weights_only=True``; read by ``read`` if given)."""

    directory = Path(path)
    if not is_deepspeed_checkpoint(directory):
        missing = [
            name for name in (STATE_FILE, "latest") if directory.is_dir() and not os.path.lexists(directory / name)
        ]
        detail = f"; {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing" if missing else ""
        raise CheckpointError(
            f"{directory} is not a DeepSpeed checkpoint directory written by phalanx (it needs '{STATE_FILE}' and"
            f" 'latest'){detail}."
        )
    file = entry_inside(directory, STATE_FILE, root=directory, what="phalanx's state file")
    if read is not None:
        state = read(file, "cpu")
        check_tensors(state, str(directory / STATE_FILE))
        return state
    with open_checkpoint_file(file, str(directory / STATE_FILE)) as handle:
        return load_bytes(handle, str(directory / STATE_FILE), map_location="cpu")


# ---------------------------------------------------------------------------- consolidation
def load_deepspeed_checkpoint_as_full(path: str | os.PathLike, *, read: Reader | None = None) -> dict[str, Any]:
    """Turn a DeepSpeed checkpoint directory into the dictionary of an ordinary single-file phalanx checkpoint.

    The result has full float32 weights under the module's own parameter names in ``state_dict`` (buffers keep their
    dtype, except float16/bfloat16 ones, which become float32), the Trainer's state as saved (``epoch``,
    ``global_step``, ``loops``, ``callbacks``, ``rng_states``, ``lr_schedulers``, ``hyper_parameters``...), and
    ``optimizer_states`` in torch's ``optimizer.state_dict()`` layout when the optimizer state can be mapped (see the
    module docstring). Needs no process group and no deepspeed installation. ``read(file, map_location)`` reads each
    file (a strategy passes its CheckpointIO's ``load_checkpoint``); by default phalanx reads them here.
    """

    directory = Path(path)
    state = read_trainer_state(directory, read=read)
    meta = state.get("deepspeed")
    tag, _ = tag_directory(directory, meta.get("tag") if isinstance(meta, dict) else None)
    files = Files(directory / tag)  # checked to lie inside; named as the user names the directory
    model_states = [load_part(file, directory, "module", read=read) for file in files.model_files]
    files.check_world_size(model_states[0].get("dp_world_size", len(files.optim_files) or 1))
    optim_states = [
        load_part(file, directory, "optimizer_state_dict", read=read)["optimizer_state_dict"]
        for file in files.optim_files
    ]
    try:
        # DeepSpeed saves its master weights with requires_grad: without no_grad, the merged tensors would carry a
        # graph (and FSDP refuses to distribute non-leaf tensors); _detached covers what passes through unchanged.
        # What the files' layout claims is built within a bound set by the bytes they hold.
        with torch.no_grad(), allocation_budget([model_states, optim_states], str(files.directory)):
            weights, optimizer_state = _detached(_consolidate(model_states, optim_states, str(files.directory)))
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        # Files that each read fine but do not fit together: cut short, of another model, of another save.
        raise CheckpointError(
            f"{files.directory}: DeepSpeed's files do not fit together (damaged, or from different checkpoints):"
            f" {type(error).__name__}: {error}"
        ) from None
    full = {key: value for key, value in state.items() if key != "deepspeed"}
    full["state_dict"] = weights
    # DeepSpeed's count of updates (global_step counts batches under accumulation), for a DeepSpeed run resumed from it.
    full[ENGINE_STEPS] = {key: int(model_states[0].get(key) or 0) for key in ("global_steps", "global_samples")}
    if "optimizer_states" in full:
        if optimizer_state is None:
            del full["optimizer_states"]  # weights and progress only: see the module docstring
            # Said in the checkpoint, so that a resume from it (or from its consolidated file) names the real cause.
            full[OPTIMIZER_OMITTED] = (
                f"the optimizer state of the DeepSpeed checkpoint {files.directory} could not be mapped to torch's"
                " optimizer layout (an optimizer whose state is not one value per parameter element, or a state"
                " offloaded to NVMe)"
            )
        else:
            full["optimizer_states"] = [optimizer_state]
    return full


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, dict):  # an OrderedDict stays one
        return type(value)((key, _detached(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    return value


def _consolidate(
    model_states: list[dict[str, Any]], optim_states: list[dict[str, Any]], source: str
) -> tuple[OrderedDict[str, Tensor], dict[str, Any] | None]:
    first = model_states[0]
    world_size = int(first.get("dp_world_size", len(optim_states) or 1))
    module = first["module"]
    buffer_names = set(first.get("buffer_names") or [])
    if not optim_states:
        # No ZeRO partitions: the module file holds the whole model and (for a torch optimizer) its usual state.
        weights = OrderedDict((name, counted_float(tensor)) for name, tensor in module.items())
        optimizer = first.get("optimizer")
        mapped = optimizer if isinstance(optimizer, dict) and set(optimizer) == {"state", "param_groups"} else None
        return weights, mapped
    if len(optim_states) != world_size:
        raise CheckpointError(
            f"{source} was saved by {world_size} processes but holds {len(optim_states)} optimizer partitions."
        )
    param_shapes: list[OrderedDict[str, Any]] = first["param_shapes"]
    if "fp32_flat_groups" in optim_states[0]:
        trainable, optimizer = _zero3(param_shapes, optim_states, world_size, source)
        frozen = _zero3_frozen(model_states)
    elif "single_partition_of_fp32_groups" in optim_states[0]:
        trainable, optimizer = _zero12(param_shapes, optim_states, source)
        frozen = {name: tensor for name, tensor in module.items() if name not in buffer_names}
    else:
        raise CheckpointError(
            f"{source}: the optimizer partitions hold no float32 master weights (optimizer state offloaded to NVMe?);"
            " they cannot be consolidated."
        )
    weights: OrderedDict[str, Tensor] = OrderedDict()
    for name, tensor in module.items():
        # The module file gives the names in state_dict order; each value comes from the most precise source.
        if name in trainable:
            weights[name] = trainable[name]
        elif name in buffer_names:
            weights[name] = counted_float(tensor)
        elif name in frozen:
            weights[name] = counted_float(frozen[name])
    for name, value in {**trainable, **frozen}.items():
        weights.setdefault(name, counted_float(value))
    for alias, owner in (first.get("shared_params") or {}).items():
        if owner in weights:
            weights[alias] = weights[owner]
    return weights, optimizer


def _zero12(
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
    per_group_states = [_group_states_12(base, len(param_shapes)) for base in bases]
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


def _zero3(
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
    bases = [state.get("optimizer_state_dict") for state in optim_states]
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


def _zero3_frozen(model_states: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Parameters outside the optimizer under ZeRO-3: each rank saved its shard of each."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    frozen = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        pieces = [state["frozen_param_fragments"][name] for state in model_states]
        frozen[name] = counted_clone(counted_cat(pieces)[:numel].view(shape))
    return frozen


__all__ = [
    "OPTIMIZER_MARKER",
    "STATE_FILE",
    "TAG",
    "is_deepspeed_checkpoint",
    "is_optimizer_marker",
    "load_deepspeed_checkpoint_as_full",
    "read_trainer_state",
]
