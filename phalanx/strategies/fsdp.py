"""FSDPStrategy: parameters, gradients and optimizer state sharded across processes with torch's FSDP2 (``fully_shard``).

Runs on CUDA with NCCL and on the CPU with gloo. ``torch.distributed.fsdp`` is imported only when an FSDPStrategy is
constructed, so ``import phalanx`` stays cheap.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, Callable, Iterable, Union

import torch
from torch import nn

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.fsdp import FSDPPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.dtensor_state import has_meta_tensors
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.sharded import ShardedStrategyMixin, check_state_dict_type
from phalanx.utilities import distributed
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: Which submodules a policy selects: a collection of layer classes, or a predicate on the module.
ModulePolicy = Union[Iterable[type], Callable[[nn.Module], bool]]
# fully_shard arguments the strategy sets itself from its own options.
_OWN_ARGUMENTS = {"module", "mesh", "mp_policy", "offload_policy"}


def module_selector(policy: ModulePolicy | None, argument: str) -> Callable[[nn.Module], bool] | None:
    """A predicate from a policy: a set/list/tuple of nn.Module classes, or a callable ``module -> bool``."""
    if policy is None:
        return None
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"{argument} must be a set of nn.Module subclasses or a callable(module) -> bool, got {policy!r}.")
        return lambda module: isinstance(module, classes)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return lambda module: isinstance(module, policy)
    if callable(policy):
        return policy
    raise TypeError(f"{argument} must be a set of nn.Module subclasses or a callable(module) -> bool, got {type(policy).__name__}.")


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them (its parameter names do not change)."""
    from torch.utils.checkpoint import checkpoint

    if "_phalanx_checkpointed_forward" in module.__dict__:
        return
    forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.__dict__["forward"] = checkpointed_forward
    module.__dict__["_phalanx_checkpointed_forward"] = forward


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(sub, FSDPModule) for sub in module.modules())


class FSDPStrategy(ShardedStrategyMixin, ParallelStrategy):
    """Fully sharded data parallelism (ZeRO-3 by default) on torch's FSDP2, on CUDA or on the CPU."""

    precision_plugin_type = FSDPPrecision
    step_collectives = {
        "forward": "FSDP parameter all-gather (forward)",
        "backward": "FSDP parameter all-gather and gradient reduce-scatter (backward)",
        "optimizer_step": "optimizer step (FSDP all-gathers, reduce-scatters and gradient-norm all-reduce)",
    }

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        cpu_offload: bool | Any = False,
        mixed_precision: Any | None = None,
        auto_wrap_policy: ModulePolicy | None = None,
        activation_checkpointing_policy: ModulePolicy | None = None,
        sharding_strategy: str = "FULL_SHARD",
        state_dict_type: str = "full",
        device_mesh: tuple[int, int] | Any | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        if not isinstance(sharding_strategy, str) or sharding_strategy.upper() not in SHARDING_STRATEGIES:
            raise ValueError(f"sharding_strategy={sharding_strategy!r} is not valid; choose one of {list(SHARDING_STRATEGIES)}.")
        self.sharding_strategy = sharding_strategy.upper()
        self._state_dict_type = check_state_dict_type(state_dict_type)
        if not isinstance(cpu_offload, bool) and type(cpu_offload).__name__ != "CPUOffloadPolicy":
            raise TypeError(f"cpu_offload must be a bool or a torch.distributed.fsdp.CPUOffloadPolicy, got {type(cpu_offload).__name__}.")
        self.cpu_offload = cpu_offload
        if mixed_precision is not None and type(mixed_precision).__name__ != "MixedPrecisionPolicy":
            raise TypeError(f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(mixed_precision).__name__}.")
        self.mixed_precision = mixed_precision
        self._wrap_selector = module_selector(auto_wrap_policy, "auto_wrap_policy")
        self._checkpoint_selector = module_selector(activation_checkpointing_policy, "activation_checkpointing_policy")
        if device_mesh is not None and self.sharding_strategy != "HYBRID_SHARD":
            raise ValueError(f"device_mesh is for sharding_strategy='HYBRID_SHARD' (replicas x shard size); got sharding_strategy={self.sharding_strategy!r}.")
        if isinstance(device_mesh, tuple) and (len(device_mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in device_mesh)):
            raise ValueError(f"device_mesh={device_mesh!r} must be a pair (replicas, shard size) of positive ints, or a 2-D DeviceMesh.")
        self._device_mesh_spec = device_mesh
        self._check_fully_shard_kwargs(kwargs)
        self._fully_shard_kwargs = kwargs
        self.device_mesh: Any = None
        self._sharded_by_strategy: nn.Module | None = None

    @staticmethod
    def _check_fully_shard_kwargs(kwargs: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        # fully_shard is wrapped by a decorator; its signature is that of the undecorated function.
        valid = set(inspect.signature(inspect.unwrap(fully_shard)).parameters) - _OWN_ARGUMENTS
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"FSDPStrategy got unexpected keyword argument(s) {unknown}; extra keyword arguments go to fully_shard, which accepts {sorted(valid)}.")

    # ------------------------------------------------------------------ precision
    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> Precision:
        """An FSDPPrecision for ``precision`` (checked against what the accelerator supports)."""
        plain = ParallelStrategy.precision_plugin_for(precision, accelerator)
        return FSDPPrecision(plain.precision, device=getattr(accelerator, "name", "cpu") or "cpu")

    # ------------------------------------------------------------------ processes
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Every rank reads its shard (``num_replicas``, ``rank``)."""
        return super().distributed_sampler_kwargs

    @property
    def pads_evaluation(self) -> bool:
        """Every forward pass gathers parameters: all ranks must run equally many, so evaluation is padded."""
        return True

    def setup_environment(self) -> None:
        """Join the process group, then build the device mesh the parameters are sharded over."""
        super().setup_environment()
        self.device_mesh = self._build_mesh()

    def _build_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        device_type = self.root_device.type
        world = self.world_size
        if isinstance(self._device_mesh_spec, DeviceMesh):
            return self._device_mesh_spec
        if self.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        if self.sharding_strategy == "NO_SHARD":
            shape = (world, 1)
        else:
            shape = self._device_mesh_spec or (self.num_nodes, self.num_processes)
        if shape[0] * shape[1] != world:
            raise ValueError(f"HYBRID_SHARD device_mesh={shape} has {shape[0] * shape[1]} processes, but the job has {world}; pass device_mesh=(replicas, shard_size) with replicas * shard_size == {world}.")
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))

    # ------------------------------------------------------------------ sharding
    def setup(self, trainer: Any) -> None:
        """Shard the module (unless the user already did in configure_model), materialise meta tensors, create optimizers."""
        assert self.accelerator is not None and self._module is not None
        self.accelerator.setup(trainer)
        module = self.precision_plugin.convert_module(self._module)
        self._module = module
        if not is_sharded(module):
            if not has_meta_tensors(module):
                self.model_to_device()
                self._broadcast_from_rank_zero(module)
            self._apply_activation_checkpointing(module)
            self._shard(module)
            self._sharded_by_strategy = module
        elif module is not self._sharded_by_strategy and (self._wrap_selector is not None or self._checkpoint_selector is not None):
            rank_zero_warn("The module was already sharded with fully_shard in configure_model: auto_wrap_policy and activation_checkpointing_policy are ignored.")
        if has_meta_tensors(module):
            self._materialize(module)
        self._model = module
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _broadcast_from_rank_zero(self, module: nn.Module) -> None:
        # fully_shard keeps each rank's own slice: ranks that initialised differently would assemble a mixed model.
        if self.world_size > 1:
            for tensor in module.state_dict().values():
                distributed.run_collective("broadcast(weights)", self.global_rank, self._timeout, lambda t=tensor: torch.distributed.broadcast(t, src=0))

    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        if self._checkpoint_selector is None:
            return
        selected = [sub for sub in module.modules() if sub is not module and self._checkpoint_selector(sub)]
        if not selected:
            rank_zero_warn("activation_checkpointing_policy selected no submodule: nothing is recomputed.")
        for sub in selected:
            checkpoint_activations(sub)

    def _fully_shard_arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {"mesh": self.device_mesh, "reshard_after_forward": self.sharding_strategy != "SHARD_GRAD_OP"}
        policy = self.mixed_precision
        if policy is None and isinstance(self.precision_plugin, FSDPPrecision):
            policy = self.precision_plugin.mixed_precision_policy()
        if policy is not None:
            arguments["mp_policy"] = policy
        if self.cpu_offload:
            if self.root_device.type == "cpu":
                rank_zero_info("cpu_offload: the model already trains on the CPU, so parameters, gradients and optimizer state stay in host memory.")
            else:
                from torch.distributed.fsdp import CPUOffloadPolicy

                arguments["offload_policy"] = self.cpu_offload if not isinstance(self.cpu_offload, bool) else CPUOffloadPolicy()
        arguments.update(self._fully_shard_kwargs)
        return arguments

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        arguments = self._fully_shard_arguments()
        if self._wrap_selector is not None:
            # Innermost first: a layer is sharded before the blocks that contain it.
            for sub in reversed(list(module.modules())):
                if sub is not module and self._wrap_selector(sub) and not is_sharded(sub):
                    fully_shard(sub, **arguments)
        fully_shard(module, **arguments)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register 'fsdp' and 'fsdp_cpu_offload'."""
        registry.register("fsdp", cls, description="Fully sharded data parallel (FSDP2), ZeRO-3 style.")
        registry.register("fsdp_cpu_offload", cls, description="Fully sharded data parallel with parameters and optimizer state offloaded to the CPU.", cpu_offload=True)

