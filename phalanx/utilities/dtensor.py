"""State of modules and optimizers whose tensors are DTensors (FSDP2, tensor parallelism).

Checkpoint files keep one layout whatever wrote them: whole tensors under the module's own parameter names, and
optimizer states as ``optimizer.state_dict()`` of an unsharded model (integer parameter ids in ``param_groups``
order). These functions gather sharded state into that layout and split whole tensors back into the shards of a
live model, so that a checkpoint moves between single-device, DDP, FSDP and tensor-parallel training.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor."""
    kind = _dtensor_type()
    return kind is not None and isinstance(value, kind)


def whole(tensor: Tensor, keep: bool) -> Tensor | None:
    """The whole of ``tensor`` on the CPU (a collective for DTensors: every rank calls it); None where not ``keep``."""
    full = tensor.full_tensor() if is_dtensor(tensor) else tensor
    return full.detach().cpu() if keep else None


def shard_like(full: Tensor, like: Tensor, name: str) -> Tensor:
    """``full`` split across ranks the way the DTensor ``like`` is (no communication: every rank holds ``full``)."""
    if not is_dtensor(like) or is_dtensor(full):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(
            f"The checkpoint's {name} has shape {tuple(full.shape)}, but the model's has shape {tuple(like.shape)}."
        )
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )


def has_dtensors(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (sharded or tensor-parallel)."""
    return any(is_dtensor(p) for p in module.parameters())


# ---------------------------------------------------------------------------- modules
def full_module_state(module: nn.Module, keep: bool) -> dict[str, Tensor]:
    """The module's state dict with whole tensors on the CPU; empty where not ``keep`` (every rank must call)."""
    full: dict[str, Tensor] = {}
    for name, value in module.state_dict().items():
        gathered = whole(value, keep) if isinstance(value, Tensor) else value
        if keep:
            full[name] = gathered
    return full


def load_module_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load whole (or already sharded) tensors into a module whose parameters may be DTensors."""
    live = module.state_dict()
    converted = {
        name: shard_like(value, live[name], name) if name in live and isinstance(value, Tensor) else value
        for name, value in state.items()
    }
    module.load_state_dict(converted, strict=strict)


# ---------------------------------------------------------------------------- optimizers
def _parameters_in_order(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _saved_ids_in_order(state: dict[str, Any]) -> list[Any]:
    return [pid for group in state["param_groups"] for pid in group["params"]]


def _sorted_items(mapping: dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    # Every rank must reach the collectives of whole() in the same order.
    return iter(sorted(mapping.items(), key=lambda item: str(item[0])))


def full_optimizer_state(optimizer: Optimizer, keep: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` with whole tensors on the CPU; empty where not ``keep`` (every rank must call)."""
    state = optimizer.state_dict()
    per_parameter: dict[Any, dict[str, Any]] = {}
    for pid, entries in _sorted_items(state["state"]):
        gathered = {
            name: whole(value, keep) if isinstance(value, Tensor) else value for name, value in _sorted_items(entries)
        }
        per_parameter[pid] = gathered
    if not keep:
        return {}
    return {"state": per_parameter, "param_groups": state["param_groups"]}


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a state in the unsharded layout into ``optimizer``, splitting per-parameter tensors like their parameter."""
    parameters = _parameters_in_order(optimizer)
    saved_ids = _saved_ids_in_order(state)
    if len(saved_ids) != len(parameters):
        raise ValueError(
            f"The checkpoint's optimizer state covers {len(saved_ids)} parameters but the optimizer has"
            f" {len(parameters)};"
            " resume with the same model and configure_optimizers."
        )
    position = {pid: index for index, pid in enumerate(saved_ids)}
    converted: dict[Any, dict[str, Any]] = {}
    for pid, entries in state["state"].items():
        parameter = parameters[position[pid]]
        converted[pid] = {
            name: shard_like(value, parameter, f"optimizer state {name!r} of parameter {pid}")
            if isinstance(value, Tensor) and tuple(value.shape) == tuple(parameter.shape) and value.dim() > 0
            else value
            for name, value in entries.items()
        }
    optimizer.load_state_dict({"state": converted, "param_groups": state["param_groups"]})


# ---------------------------------------------------------------------------- creating parameters on the meta device
def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta tensors of a (sharded) module on ``device`` and initialise them with ``reset_parameters``.

    Each module's initialiser runs on whole-size temporary tensors, identically on every rank (all ranks seeded
    alike), and every rank keeps its own shard: the model equals one built without the meta device from the same
    seed, when ``reset_parameters`` runs in the order the modules were created. Random initialisers applied to
    DTensors directly would not do: on the CPU every shard would get the same numbers.
    """
    uninitialised = [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if _owns_meta_tensors(sub) and not callable(getattr(sub, "reset_parameters", None))
    ]
    if uninitialised:
        raise ValueError(
            "These modules were created on the meta device but have no reset_parameters() to initialise them:"
            f" {uninitialised}."
            " Give them a reset_parameters() method, or create them without empty_init=True."
        )
    meta_modules = [sub for sub in module.modules() if _owns_meta_tensors(sub)]
    module.to_empty(device=device)
    with torch.no_grad():
        for sub in meta_modules:
            _reset_on_whole_tensors(sub)


def _owns_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def _reset_on_whole_tensors(module: nn.Module) -> None:
    slots = [(module._parameters, name) for name, p in module._parameters.items() if p is not None]
    slots += [(module._buffers, name) for name, b in module._buffers.items() if b is not None]
    originals = [(table, name, table[name]) for table, name in slots]
    try:
        for table, name, tensor in originals:
            stand_in = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
            table[name] = (
                nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else stand_in
            )
        module.reset_parameters()  # type: ignore[operator]
        initialised = {(id(table), name): table[name] for table, name, _ in originals}
    finally:
        for table, name, tensor in originals:
            table[name] = tensor
    for table, name, tensor in originals:
        value = initialised[(id(table), name)]
        target = tensor.to_local() if is_dtensor(tensor) else tensor
        target.copy_(shard_like(value.detach(), tensor, name).to_local() if is_dtensor(tensor) else value.detach())
