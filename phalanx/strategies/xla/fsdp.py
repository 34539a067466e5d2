"""XLAFSDPStrategy ("xla_fsdp"): torch_xla's fully sharded data parallel, one replica per XLA device.

Each replica holds a flat 1-D shard of every parameter, of its gradient and of the optimizer's state; the wrapper
all-gathers parameters for each forward and backward and reduce-scatters gradients itself (no all-reduce on top).
The optimizer the module's ``configure_optimizers`` builds on its own parameters is pointed at their shards, so the
Lightning idiom ``torch.optim.Adam(self.parameters())`` works unchanged. Checkpoints hold whole CPU tensors under the
module's own names (gathered from the shards), so they load with ``weights_only=True`` in a plain CPU process, into
a single-device model, or back into xla_fsdp on any number of devices.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.xla import local_device_count
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.formats.xla_fsdp import ShardState, consolidate_xla_fsdp, read_own_pieces, write_sharded
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.parallel import DEFAULT_TIMEOUT
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.strategies.xla import _collectives as collectives
from phalanx.strategies.xla._common import refuse_compile, to_cpu
from phalanx.strategies.xla._fsdp_state import ModuleTree, ShardedParameters, undo_activation_checkpointing
from phalanx.strategies.xla.replicas import XLAStrategy
from phalanx.utilities.registry import Registry

#: Options phalanx sets itself (the wrapper's other keyword arguments pass through).
_RESERVED = ("auto_wrap_policy", "auto_wrapper_callable", "pin_layout_in_collective_ops", "flatten_parameters")


def _check_class_set(name: str, value: Any) -> None:
    if isinstance(value, type) and issubclass(value, nn.Module):
        return
    if isinstance(value, (set, frozenset, list, tuple)) and value:
        if all(isinstance(item, type) and issubclass(item, nn.Module) for item in value):
            return
    raise TypeError(
        f"XLAFSDPStrategy({name}={value!r}) must be an nn.Module class or a non-empty set of them"
        + (", or a callable (module, recurse, unwrapped_params) -> bool." if name == "auto_wrap_policy" else ".")
    )


def _class_set(value: Any) -> frozenset[type[nn.Module]]:
    if value is None:
        return frozenset()
    return frozenset({value} if isinstance(value, type) else value)


def _either_policy(first: Callable[..., bool], second: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
    return bool(first(*args, **kwargs) or second(*args, **kwargs))


def _checkpointed_unit(module: nn.Module, *args: Any, classes: tuple[type[nn.Module], ...], **kwargs: Any) -> nn.Module:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module

    if isinstance(module, classes):
        module = checkpoint_module(module)
    return XlaFullyShardedDataParallel(module, *args, **kwargs)


class XLAFSDPStrategy(XLAStrategy):
    """Fully sharded data parallel on XLA devices (torch_xla's ``XlaFullyShardedDataParallel``).

    Args:
        auto_wrap_policy: module classes (a class or a set) each wrapped in its own shard unit, or torch_xla's callable
            ``(module, recurse, unwrapped_params) -> bool``; None wraps the whole module as one unit.
        activation_checkpointing_policy: module classes (a class or a set) whose activations are recomputed in the
            backward pass (torch_xla's ``checkpoint_module``); each such module becomes its own shard unit too.
        state_dict_type: "full": one file of whole tensors under the module's own names (written by rank 0);
            "sharded": a directory where each replica writes its own pieces (no gathering; see
            ``xla_fsdp_checkpoint``). Either resumes on xla_fsdp with any number of devices, or on any other strategy.
        **wrapper_options: passed to ``XlaFullyShardedDataParallel`` (e.g. ``compute_dtype``).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        state_dict_type: str = "full",
        cluster_environment: ClusterEnvironment | None = None,
        sync_module_states: bool = True,
        start_method: str = "spawn",
        timeout: timedelta = DEFAULT_TIMEOUT,
        **wrapper_options: Any,
    ) -> None:
        if auto_wrap_policy is not None and not callable(auto_wrap_policy) or isinstance(auto_wrap_policy, type):
            _check_class_set("auto_wrap_policy", auto_wrap_policy)
        if activation_checkpointing_policy is not None:
            _check_class_set("activation_checkpointing_policy", activation_checkpointing_policy)
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f"XLAFSDPStrategy(state_dict_type={state_dict_type!r}) is not valid; choose 'full' (one file of whole"
                " tensors under the module's names, written by rank 0) or 'sharded' (a directory: each replica writes"
                " its own pieces)."
            )
        reserved = [name for name in wrapper_options if name in _RESERVED]
        if reserved:
            raise TypeError(
                f"XLAFSDPStrategy sets {reserved} itself; pass auto_wrap_policy / activation_checkpointing_policy"
                " instead (flatten_parameters stays False so that each shard belongs to one parameter)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            cluster_environment=cluster_environment,
            sync_module_states=sync_module_states,
            start_method=start_method,
            timeout=timeout,
        )
        self._auto_wrap_policy = auto_wrap_policy
        self._checkpointed = _class_set(activation_checkpointing_policy)
        self._state_dict_type = state_dict_type
        self._wrapper_options = wrapper_options
        self._shards: ShardedParameters | None = None

    # ------------------------------------------------------------------ set-up
    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what torch_xla's wrapper cannot run."""
        refuse_compile(self, settings)
        if self.layer_sync is not None:
            raise ValueError("sync_batchnorm=True (or a LayerSync plugin) is not supported by XLAFSDPStrategy.")
        if self.precision_plugin.precision == "bf16-true":
            raise ValueError(
                "XLAFSDPStrategy shards float32 parameters only (torch_xla's wrapper refuses others): use"
                " precision='bf16-mixed', or XLAFSDPStrategy(compute_dtype=torch.bfloat16)."
            )
        if self.world_size == 1 and (host_devices := local_device_count()) > 1:
            # The wrapper still reduce-scatters over every device of the host: XLA's compiler refuses that graph
            # (measured on 2 CPU devices: "shard_count == subgroup_size" failed in the first training step).
            raise ValueError(
                f"XLAFSDPStrategy on 1 of this host's {host_devices} XLA devices is not supported by torch_xla's"
                f" wrapper: pass devices={host_devices} (or 'auto'), or strategy='single_xla' for one device."
            )
        if self._checkpointed and collectives.threads_share_process():
            # Measured on torch_xla's CPU runtime (replicas as threads of one process): the recomputation in the
            # backward pass ran before its shard unit gathered its parameters again (shape errors, 4 runs of 4), while
            # one device per process matched plain PyTorch every time.
            raise ValueError(
                "XLAFSDPStrategy(activation_checkpointing_policy=...) is not supported where replicas are threads of"
                " one process (torch_xla's CPU runtime with several devices): torch_xla's recomputation fails there."
                " Run one replica per process (as on TPU), or leave the policy out."
            )

    def place_module(self, settings: RunSettings) -> None:
        """Move the module to the device, then make the replicas equal."""
        self.model_to_device()
        if self._sync_module_states and self.world_size > 1:
            self._broadcast_module_states()

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Build the optimizers on the whole parameters, wrap the module, then point the optimizers at the shards."""
        assert self._module is not None
        if settings.fitting:
            self.setup_optimizers(settings)  # on the whole parameters: the module's own configure_optimizers
        tree = ModuleTree.of(self._module)
        self._model = self._wrap(self._module)
        self._shards = ShardedParameters.of(self._model, tree, rank=self.global_rank, world_size=self.world_size)
        for optimizer in self.optimizers:
            self._shards.point_at_shards(optimizer)

    def _broadcast_module_states(self) -> None:
        super()._broadcast_module_states()
        # The broadcast leaves each tensor a view of the collective's result; torch_xla's wrapper swaps the storage of
        # the parameters it shards, which does not take on such views (weights stayed at their first value: measured).
        # Fresh copies first.
        assert self._module is not None
        with torch.no_grad():
            for tensor in [*self._module.parameters(), *self._module.buffers()]:
                tensor.data = tensor.detach().clone()
        collectives.cut_graph(keep_generator=True)

    def _wrap(self, module: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

        options: dict[str, Any] = dict(self._wrapper_options)
        # The native all-gather / reduce-scatter: the pinned-layout ones build another graph on each CPU device.
        options["pin_layout_in_collective_ops"] = not collectives.threads_share_process()
        policy = self._auto_wrap_policy
        if isinstance(policy, type) or isinstance(policy, (set, frozenset, list, tuple)):
            policy = partial(transformer_auto_wrap_policy, transformer_layer_cls=_class_set(policy))
        if self._checkpointed:
            # A checkpointed module must be a shard unit of its own: its recomputation then runs inside the unit's
            # backward, after the unit gathered its parameters again.
            units = partial(transformer_auto_wrap_policy, transformer_layer_cls=self._checkpointed)
            policy = units if policy is None else partial(_either_policy, policy, units)
            options["auto_wrapper_callable"] = partial(_checkpointed_unit, classes=tuple(self._checkpointed))
        if policy is not None:
            options["auto_wrap_policy"] = policy
        return XlaFullyShardedDataParallel(module, **options)

    # The wrapper's all-gathers and reduce-scatters sit inside the forward and backward graphs. Every graph holding
    # them must be launched at phalanx's graph cut (replica threads take turns there), never by the dataloader's own
    # sync before the next batch: so the graph is cut after each backward pass and after each evaluation step.
    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        result = super()._run_step(method, context, *args, **kwargs)
        if method != "training_step":
            collectives.cut_graph()
        return result

    def post_backward(self, closure_loss: Tensor) -> None:
        """Launch the backward graph (with its reduce-scatters) at phalanx's graph cut."""
        super().post_backward(closure_loss)
        collectives.cut_graph()

    def _before_optimizer_step(self) -> Callable[[Optimizer], None] | None:
        # The wrapper reduce-scatters gradients in the backward pass: no all-reduce on top of it (XLAStrategy's).
        return super(XLAStrategy, self)._before_optimizer_step()

    def clip_gradients(
        self,
        module: nn.Module | None,
        optimizer: Optimizer,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
    ) -> Tensor | None:
        """By norm: the norm of the whole model's gradients, computed over the shards; by value: on each shard."""
        by_norm = clip_val is None and isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
        if not by_norm or max_norm <= 0 or self._shards is None:  # type: ignore[operator]
            # Validation, no clipping (0), or by value: element by element, the same on shards as on whole tensors.
            return super().clip_gradients(module, optimizer, max_norm=max_norm, clip_val=clip_val)
        return self._model.clip_grad_norm_(max_norm)  # type: ignore[union-attr, operator]

    # ------------------------------------------------------------------ checkpoints
    def declare_traits(self) -> StrategyTraits:
        """Checkpoints load after ``setup``, into the shards: each replica keeps its own piece of every tensor."""
        return replace(super().declare_traits(), restore_checkpoint_after_setup=True)

    def module_state_dict(self) -> dict[str, Any]:
        """'full': whole CPU tensors under the module's names (every replica gathers); 'sharded': this replica's
        pieces."""
        if self._shards is None:
            return super().module_state_dict()
        if self._state_dict_type == "sharded":
            return self._shards.own_pieces()
        assert self._module is not None
        return self._shards.full_module_state(self._module, self.root_device)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state with whole tensors in the module's parameters' layout ('full'), or its pieces."""
        if self._shards is None:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if self._state_dict_type == "sharded":
            return optimizer.state_dict()
        return self._shards.full_optimizer_state(optimizer, self.root_device)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """'full': rank 0 writes one file; 'sharded': every replica writes its pieces into the directory ``filepath``
        (both through the CheckpointIO)."""
        if self._state_dict_type != "sharded" or self._shards is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        collectives.cut_graph(keep_generator=True)
        write_sharded(
            self.checkpoint_io,
            to_cpu(checkpoint),
            filepath,
            layout=self._shards.layout(self.optimizers),
            collectives=Collectives.of(self),
            all_succeeded=lambda ok: self.reduce_boolean_decision(ok, all=True),
            storage_options=storage_options,
        )

    def load_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """A sharded directory written by as many replicas: each reads its own pieces; anything else: whole tensors
        (read through the CheckpointIO), each replica keeping its piece."""
        if checkpoint_layout(checkpoint_path) == "xla_fsdp":
            read = self.checkpoint_io.load_checkpoint
            own = read_own_pieces(checkpoint_path, rank=self.global_rank, world_size=self.world_size, read=read)
            return own if own is not None else consolidate_xla_fsdp(checkpoint_path, read=read)
        return super().load_checkpoint(checkpoint_path)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load whole weights, or this replica's pieces: each replica keeps its own shard of every parameter."""
        if self._shards is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        state = checkpoint["state_dict"]
        self._shards.load_module_state(state, strict=strict, pieces=isinstance(state, ShardState))

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Load whole optimizer states (each replica cuts its shards) or this replica's own."""
        if self._shards is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s) but configure_optimizers created"
                f" {len(self.optimizers)}; resume with the same optimizer configuration."
            )
        for optimizer, state in zip(self.optimizers, states):
            optimizer = getattr(optimizer, "optimizer", optimizer)
            if isinstance(state, ShardState):
                optimizer.load_state_dict(dict(state))
            else:
                self._shards.load_full_optimizer_state(optimizer, state)

    def teardown(self) -> None:
        """Give the module back its whole parameters (every replica gathers them: rank 0's go back to the caller)."""
        shards, self._shards = self._shards, None
        if shards is not None and self._module is not None:
            shards.restore_whole_parameters(self._module, self.root_device)
            undo_activation_checkpointing(self._module)
            self._model = self._module
        super().teardown()

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register "xla_fsdp"."""
        registry.register("xla_fsdp", cls, description="Fully sharded data parallel over XLA devices (torch_xla).")


__all__ = ["XLAFSDPStrategy"]
