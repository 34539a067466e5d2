"""What the strategies whose model is split into DTensors (FSDP, ModelParallel) share: steps through the sharded
module, gradient accumulation without synchronisation, creation on the meta device, and checkpoints."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.optimization import load_scheduler_states
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.strategies.forward_redirection import redirect_forward
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities.dtensor import (
    full_module_state,
    full_optimizer_state,
    load_module_state,
    load_optimizer_state,
    materialize,
)
from phalanx.utilities.init import empty_init_context
from phalanx.utilities.optimizer_names import state_by_position

STATE_DICT_TYPES = ("full", "sharded")


def check_state_dict_type(state_dict_type: str) -> str:
    """Validate ``state_dict_type``."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r} is not valid; choose one of {list(STATE_DICT_TYPES)}.")
    return state_dict_type


class ShardedStrategyMixin:
    """Mixed into a ParallelStrategy whose module holds DTensors; reads ``self._state_dict_type``.

    Checkpoints are whole files ('full', gathered on rank 0) or sharded DCP directories ('sharded'), and either
    loads. Loading runs after ``setup`` (the model is sharded and the optimizers exist), so a sharded directory is
    read straight into each rank's shards and a whole file is split as it is loaded; optimizer and scheduler states
    are restored there too.
    """

    _state_dict_type: str

    # ------------------------------------------------------------------ steps
    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        # The sharded module is its own wrapper: fully_shard's forward hooks gather the parameters, so every step
        # goes through the module's __call__.
        with context:
            return redirect_forward(self._module, self._module, method, *args, **kwargs)  # type: ignore[attr-defined]

    def declare_traits(self) -> StrategyTraits:
        """Every forward pass runs collectives (gathers parameters, or tensor-parallel ones): all ranks must run
        equally many, so evaluation is padded. No inference mode: FSDP2 keeps the buffers it gathers parameters into,
        and made in inference mode training cannot fill them. Checkpoints load into the sharded model, after
        ``setup``, optimizer and scheduler states included."""
        return replace(
            super().declare_traits(),  # type: ignore[misc]
            pads_evaluation=True,
            allows_inference_mode=False,
            restore_checkpoint_after_setup=True,
            restores_optimizer=True,
        )

    def block_backward_sync(self) -> AbstractContextManager:
        """While accumulating, FSDP keeps gradients unsharded and reduces them once, on the last micro-batch."""
        module = self._module  # type: ignore[attr-defined]
        if module is None or not hasattr(module, "set_requires_gradient_sync"):
            return super().block_backward_sync()  # type: ignore[misc]
        return _without_gradient_sync(module)

    # ------------------------------------------------------------------ creating parameters
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``empty_init=True`` creates parameters on the meta device; ``setup`` materialises them, sharded."""
        if not empty_init:
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield
            return
        with ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            stack.enter_context(empty_init_context(True))
            stack.enter_context(self.precision_plugin.tensor_init_context())  # type: ignore[attr-defined]
            yield

    def _materialize(self, module: nn.Module) -> None:
        # Every rank initialises from rank 0's generator state, so that the shards of one tensor fit together.
        with torch.random.fork_rng(devices=[]):
            if self.world_size > 1:  # type: ignore[attr-defined]
                torch.set_rng_state(self.broadcast(torch.get_rng_state()))  # type: ignore[attr-defined]
            materialize(module, self.root_device)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ checkpoints

    def module_state_dict(self) -> dict[str, Any]:
        """'full': whole tensors on rank 0 (other ranks get an empty dict); 'sharded': this rank's shards."""
        if self._state_dict_type == "sharded":
            return self._module.state_dict()  # type: ignore[attr-defined]
        return full_module_state(self._module, keep=self.is_global_zero)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state in the unsharded layout: whole tensors on rank 0 ('full') or this rank's shards."""
        if self._state_dict_type == "sharded":
            return optimizer.state_dict()
        return full_optimizer_state(optimizer, keep=self.is_global_zero)  # type: ignore[attr-defined]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """'full': rank 0 writes one file; 'sharded': every rank writes its shards into the directory ``filepath``
        (both through the CheckpointIO)."""
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
        self.checkpoint_io.save_sharded_checkpoint(  # type: ignore[attr-defined]
            checkpoint, filepath, collectives=Collectives.of(self), storage_options=storage_options
        )

    def load_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """Read a checkpoint into the sharded model; when fitting, restore optimizer and scheduler states as well."""
        io = self.checkpoint_io  # type: ignore[attr-defined]
        if checkpoint_layout(checkpoint_path) == "sharded":
            checkpoint = io.load_sharded_checkpoint(
                checkpoint_path,
                module_state=self._module.state_dict(),  # type: ignore[attr-defined]
                optimizers=self.optimizers,  # type: ignore[attr-defined]
            )
        else:
            checkpoint = io.load_checkpoint(checkpoint_path)
        if self.optimizers and "optimizer_states" in checkpoint:  # type: ignore[attr-defined]
            self.load_optimizer_state_dict(checkpoint)
            configs = self.lr_scheduler_configs  # type: ignore[attr-defined]
            load_scheduler_states(configs, checkpoint.get("lr_schedulers", []), "The checkpoint")
        return checkpoint

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load whole or sharded weights into the sharded module."""
        load_module_state(self._module, checkpoint["state_dict"], strict=strict)  # type: ignore[attr-defined]

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Load optimizer states in the unsharded layout, splitting them like the parameters."""
        states = checkpoint["optimizer_states"]
        optimizers = self.optimizers  # type: ignore[attr-defined]
        if len(states) != len(optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s) but configure_optimizers created"
                f" {len(optimizers)}; resume with the same optimizer configuration."
            )
        for optimizer, state in zip(optimizers, states):  # a pipeline's states name their parameters
            load_optimizer_state(optimizer, state_by_position(optimizer, self._module, state))  # type: ignore[attr-defined]


@contextmanager
def _without_gradient_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]
