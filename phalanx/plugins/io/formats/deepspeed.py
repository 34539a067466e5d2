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

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from phalanx.plugins.io.bounded_reads import (
    allocation_budget,
    check_tensors,
    counted_float,
    open_checkpoint_file,
)
from phalanx.plugins.io.checkpoint_files import OPTIMIZER_OMITTED, entry_inside
from phalanx.plugins.io.formats.deepspeed_files import Files, load_part, tag_directory
from phalanx.plugins.io.formats.deepspeed_zero import zero3, zero3_frozen, zero12
from phalanx.plugins.io.serialization import load_bytes
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
        trainable, optimizer = zero3(param_shapes, optim_states, world_size, source)
        frozen = zero3_frozen(model_states)
    elif "single_partition_of_fp32_groups" in optim_states[0]:
        trainable, optimizer = zero12(param_shapes, optim_states, source)
        frozen = {name: tensor for name, tensor in module.items() if name not in buffer_names}
    else:
        raise CheckpointError(
            f"{source}: the optimizer partitions hold no float32 master weights (optimizer state offloaded to NVMe?);"
            " they cannot be consolidated."
        )
    weights = OrderedDict()
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


__all__ = [
    "OPTIMIZER_MARKER",
    "STATE_FILE",
    "TAG",
    "is_deepspeed_checkpoint",
    "is_optimizer_marker",
    "load_deepspeed_checkpoint_as_full",
    "read_trainer_state",
]
