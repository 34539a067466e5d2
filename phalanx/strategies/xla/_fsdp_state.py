"""The shards of torch_xla's fully sharded wrapper, mapped to the module's own parameter names.

``XlaFullyShardedDataParallel`` (with ``flatten_parameters=False``) replaces every parameter of the wrapped module by
a 1-D shard: the parameter flattened, padded to a multiple of the world size, and cut in ``world_size`` equal pieces;
replica ``r`` holds piece ``r``. The original parameter is taken off its module (only the wrapper's shards are
registered) and keeps a handle to its shard. This module gathers whole tensors from the shards (for checkpoints and
for the weights a run ends with) and cuts whole tensors back into this replica's shards (for resuming).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.strategies.xla import _collectives as collectives


@dataclass
class _Sharded:
    name: str  # the parameter's name in the module the strategy was given
    whole: nn.Parameter  # the original parameter object (its storage freed by the wrapper)
    shard: nn.Parameter  # this replica's 1-D piece, registered on the wrapper
    size: torch.Size
    owner: nn.Module  # the module the parameter belonged to, and its attribute name there
    attribute: str


@dataclass
class ModuleTree:
    """The module's parameters, buffers and children as they were before wrapping (wrappers replace children)."""

    parameter_names: dict[int, str]
    buffers: list[tuple[str, Tensor]]
    children: list[tuple[nn.Module, str, nn.Module]]

    @classmethod
    def of(cls, module: nn.Module) -> ModuleTree:
        """Record ``module`` before it is wrapped."""
        return cls(
            {id(parameter): name for name, parameter in module.named_parameters()},
            list(module.named_buffers()),
            [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()],
        )

    def restore_children(self) -> None:
        """Put the original children back where nested wrappers took their place."""
        for parent, name, child in self.children:
            if parent._modules.get(name) is not child:
                parent._modules[name] = child


class ShardedParameters:
    """Every sharded parameter of a wrapped module, in the order of the module's own ``named_parameters()``."""

    def __init__(self, entries: list[_Sharded], tree: ModuleTree, rank: int, world_size: int) -> None:
        self.entries, self.tree = entries, tree
        self.rank, self.world_size = rank, world_size
        self._by_whole = {id(entry.whole): entry for entry in entries}

    @classmethod
    def of(cls, wrapped: nn.Module, tree: ModuleTree, *, rank: int, world_size: int) -> ShardedParameters:
        """The shards of every wrapper unit in ``wrapped`` (``tree``: the module as it was before wrapping)."""
        found: dict[str, _Sharded] = {}
        for unit in wrapped.modules():
            infos = getattr(unit, "full_param_infos", ())
            for whole, shard, (_, owner, attribute) in zip(
                getattr(unit, "full_params", ()), getattr(unit, "sharded_params", ()), infos
            ):
                name = tree.parameter_names.get(id(whole))
                assert name is not None, "a sharded parameter that the module did not have before wrapping"
                found[name] = _Sharded(name, whole, shard, torch.Size(shard._orig_size), owner, attribute)
        order = list(tree.parameter_names.values())
        return cls([found[name] for name in order if name in found], tree, rank, world_size)

    # ------------------------------------------------------------------ optimizers
    def point_at_shards(self, optimizer: Optimizer) -> None:
        """Replace the module's parameters in ``optimizer`` by their shards (before the first step: no state yet)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        assert not optimizer.state, "the optimizer already holds state for the whole parameters"
        for group in optimizer.param_groups:
            group["params"] = [self._by_whole[id(p)].shard if id(p) in self._by_whole else p for p in group["params"]]

    # ------------------------------------------------------------------ this replica's pieces (sharded checkpoints)
    def layout(self, optimizers: list[Optimizer]) -> dict[str, Any]:
        """What a reader needs to make whole tensors of the pieces: shapes, replicas, the optimizers' parameters."""
        names = {id(entry.shard): entry.name for entry in self.entries}
        owners = [
            [names.get(id(p)) for group in getattr(o, "optimizer", o).param_groups for p in group["params"]]
            for o in optimizers
        ]
        parameters = {
            entry.name: {"shape": list(entry.size), "piece": list(entry.shard.shape)} for entry in self.entries
        }
        return {"format": 1, "world_size": self.world_size, "parameters": parameters, "optimizer_parameters": owners}

    def own_pieces(self) -> dict[str, Tensor]:
        """This replica's piece of every parameter, and every buffer whole (on the device)."""
        state = {entry.name: entry.shard.detach() for entry in self.entries}
        state.update({name: buffer.detach() for name, buffer in self.tree.buffers})
        return state

    # ------------------------------------------------------------------ whole <-> shard
    def _gather(self, piece: Tensor, size: torch.Size, device: torch.device) -> Tensor:
        pieces = collectives.all_gather(piece.detach(), device) if self.world_size > 1 else piece.detach()[None]
        return pieces.cpu().reshape(-1)[: size.numel()].reshape(size)

    def _cut(self, whole: Tensor, like: Tensor) -> Tensor:
        flat = whole.detach().reshape(-1).to(like.dtype)
        piece = like.numel()
        padded = torch.zeros(piece * self.world_size, dtype=like.dtype)
        padded[: flat.numel()] = flat
        return padded[self.rank * piece : (self.rank + 1) * piece].reshape(like.shape).to(like.device)

    def full_module_state(self, module: nn.Module, device: torch.device) -> dict[str, Tensor]:
        """Whole CPU tensors of every parameter (gathered: every replica calls) and of every buffer."""
        state = {entry.name: self._gather(entry.shard, entry.size, device) for entry in self.entries}
        state.update({name: buffer.detach().cpu() for name, buffer in self.tree.buffers})
        return state

    def load_module_state(self, state: dict[str, Any], *, strict: bool, pieces: bool) -> None:
        """Load whole parameters (each cut to this replica's shard) or, with ``pieces``, this replica's own pieces
        (written by as many replicas); buffers are whole either way."""
        buffers = dict(self.tree.buffers)
        expected = [entry.name for entry in self.entries] + list(buffers)
        missing = [name for name in expected if name not in state]
        unexpected = [name for name in state if name not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"The checkpoint's weights do not fit the module: missing {missing}, unexpected {unexpected}."
            )
        with torch.no_grad():
            for entry in self.entries:
                value = state.get(entry.name)
                if value is None:
                    continue
                shape = tuple(entry.shard.shape if pieces else entry.size)
                if tuple(value.shape) != shape:
                    what = "this replica's shard" if pieces else "the module's"
                    raise RuntimeError(
                        f"The checkpoint's {'piece of ' if pieces else ''}{entry.name} has shape"
                        f" {tuple(value.shape)}, {what} {shape}."
                    )
                piece = value.to(entry.shard.dtype).to(entry.shard.device) if pieces else self._cut(value, entry.shard)
                entry.shard.copy_(piece)
            for name, buffer in buffers.items():
                if name in state:
                    buffer.copy_(state[name].to(buffer.device))

    def full_optimizer_state(self, optimizer: Optimizer, device: torch.device) -> dict[str, Any]:
        """``optimizer.state_dict()`` with each shard-shaped state tensor gathered whole (every replica calls)."""
        saved = optimizer.state_dict()
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = {id(entry.shard): entry.size for entry in self.entries}
        state: dict[Any, dict[str, Any]] = {}
        for index, parameter in enumerate(shards):
            entries = saved["state"].get(index)
            if entries is None:
                continue
            size = sizes.get(id(parameter))
            state[index] = {
                key: self._gather(value, size, device)
                if size is not None and isinstance(value, Tensor) and value.shape == parameter.shape
                else (value.cpu() if isinstance(value, Tensor) else value)
                for key, value in entries.items()
            }
        return {"state": state, "param_groups": saved["param_groups"]}

    def load_full_optimizer_state(self, optimizer: Optimizer, saved: dict[str, Any]) -> None:
        """Load a whole optimizer state: each state tensor of a parameter's whole shape is cut to this shard."""
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = {id(entry.shard): entry.size for entry in self.entries}
        state: dict[Any, dict[str, Any]] = {}
        for index, entries in saved.get("state", {}).items():
            parameter = shards[index] if isinstance(index, int) and 0 <= index < len(shards) else None
            size = sizes.get(id(parameter)) if parameter is not None else None
            state[index] = {
                key: self._cut(value, parameter)
                if parameter is not None
                and size is not None
                and isinstance(value, Tensor)
                and tuple(value.shape) == tuple(size)
                else value
                for key, value in entries.items()
            }
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    def restore_whole_parameters(self, module: nn.Module, device: torch.device) -> None:
        """Give ``module`` back its parameters, whole (every replica calls): what a run ends with."""
        for entry in self.entries:
            whole = self._gather(entry.shard, entry.size, device)
            # The wrapper left the emptied parameter on its module as a plain attribute: a parameter again.
            entry.owner.__dict__.pop(entry.attribute, None)
            entry.owner.register_parameter(
                entry.attribute, nn.Parameter(whole, requires_grad=entry.whole.requires_grad)
            )
        self.tree.restore_children()


def undo_activation_checkpointing(module: nn.Module) -> None:
    """Give every module that torch_xla's ``checkpoint_module`` changed its own ``forward`` back."""
    for child in module.modules():
        if "_xla_checkpointed_forward_original" in child.__dict__:
            for name in ("forward", "_xla_checkpointed_forward_original", "_xla_checkpointed_forward_no_kwargs"):
                child.__dict__.pop(name, None)


__all__ = ["ShardedParameters", "undo_activation_checkpointing"]
