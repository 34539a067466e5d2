"""FSDPStrategy: parameters, gradients and optimizer state sharded across processes with torch's FSDP2
(``fully_shard``).

Runs on CUDA with NCCL and on the CPU with gloo. ``torch.distributed.fsdp`` is imported only when an FSDPStrategy is
constructed, so ``import phalanx`` stays cheap.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.fsdp import FSDPPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.fsdp import _fsdp1_arguments as fsdp1
from phalanx.strategies.fsdp._fsdp1_arguments import HYBRID_STRATEGIES, KEEP_GATHERED_AFTER_FORWARD, ModulePolicy
from phalanx.strategies.fsdp._sharded import ShardedStrategyMixin, check_state_dict_type
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.parallel_dims import MeshAxis, ParallelDims
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed
from phalanx.utilities.dtensor import has_meta_tensors, is_dtensor
from phalanx.utilities.init import empty_init_context
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn
from phalanx.utilities.registry import Registry

_HYBRID_AXES = (MeshAxis.DATA_REPLICATE, MeshAxis.DATA_SHARD)
_HYBRID_NAMES = tuple(axis.value for axis in _HYBRID_AXES)
# fully_shard arguments the strategy sets itself from its own options.
_OWN_ARGUMENTS = {"module", "mesh", "mp_policy", "offload_policy"}


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


# FSDP2's own work per step at world size 1 (bench/bench_step_work.py): a hand-written fully_shard loop on a 2-layer MLP
# runs 1.16x the aten ops and 3.7x the Python calls of the same loop without it; phalanx adds nothing to that.
ONE_PROCESS_NOTICE = (
    "FSDP with one process shards nothing, yet every step still copies each parameter through FSDP's gather buffers"
    " and each gradient through its reduce buffers (about 1.2x the aten ops and 3.5x the Python calls of a"
    " single-device step on a small model). Use strategy='single_device' to train on one device; keep 'fsdp' to test"
    " the sharded set-up before scaling out."
)


class FSDPStrategy(ShardedStrategyMixin, ParallelStrategy):
    """Fully sharded data parallelism (ZeRO-3 by default) on torch's FSDP2, on CUDA or on the CPU."""

    precision_plugin_type = FSDPPrecision
    # Each block: fully_shard's all-gather and reduce-scatter hooks sit at block boundaries and run eagerly around the
    # compiled blocks, as torchtitan does (a whole-model graph would have to trace through them).
    default_compile_unit = "blocks"
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
        cpu_offload: bool | Any | None = None,
        mixed_precision: Any | None = None,
        auto_wrap_policy: ModulePolicy | None = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: ModulePolicy | None = None,
        sharding_strategy: str | Any = "FULL_SHARD",
        state_dict_type: str = "full",
        device_mesh: tuple[int, ...] | Any | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Lightning's FSDP1 forms (CPUOffload, MixedPrecision, ShardingStrategy, wrap policies, ...) translated once.
        self.sharding_strategy = fsdp1.sharding_strategy_name(sharding_strategy)
        self._state_dict_type = check_state_dict_type(state_dict_type)
        self.cpu_offload = fsdp1.cpu_offload_setting(cpu_offload)
        self.mixed_precision = fsdp1.mixed_precision_policy(mixed_precision)
        self._wrap_picker = fsdp1.module_picker(auto_wrap_policy, "auto_wrap_policy")
        checkpointing = fsdp1.checkpointing_policy(activation_checkpointing, activation_checkpointing_policy)
        self._checkpoint_picker = fsdp1.module_picker(checkpointing, "activation_checkpointing_policy")
        self._fully_shard_kwargs, self._process_group = fsdp1.seed_keyword_arguments(kwargs, self._fully_shard_names())
        fsdp1.check_process_group(self._process_group, hybrid=self.sharding_strategy in HYBRID_STRATEGIES)
        self._device_mesh_spec = self._check_device_mesh(device_mesh)
        self.device_mesh: Any = None
        self._sharded_by_strategy: nn.Module | None = None
        self._marked_for_sharding: list[nn.Module] = []

    @property
    def reshard_after_forward(self) -> bool | int:
        """Whether gathered parameters are freed after each layer's forward (ZeRO-3) or kept until backward (ZeRO-2)."""
        return self._fully_shard_kwargs.get(
            "reshard_after_forward", self.sharding_strategy not in KEEP_GATHERED_AFTER_FORWARD
        )

    @staticmethod
    def _fully_shard_names() -> set[str]:
        from torch.distributed.fsdp import fully_shard

        # fully_shard is wrapped by a decorator; its signature is that of the undecorated function.
        return set(inspect.signature(inspect.unwrap(fully_shard)).parameters) - _OWN_ARGUMENTS

    def _check_device_mesh(self, device_mesh: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        hybrid = self.sharding_strategy in HYBRID_STRATEGIES
        dims = 2 if hybrid else 1
        if device_mesh is None:
            return None
        if self._process_group is not None:
            raise ValueError(
                "FSDPStrategy(process_group=..., device_mesh=...): pass only one of them; both say which processes"
                " shard the model."
            )
        if isinstance(device_mesh, DeviceMesh):
            if device_mesh.ndim != dims:
                raise ValueError(
                    f"device_mesh has {device_mesh.ndim} dimension(s), but"
                    f" sharding_strategy={self.sharding_strategy!r} needs a {dims}-D"
                    f" mesh{' (replicate, shard)' if hybrid else ''}."
                )
            return device_mesh
        if not isinstance(device_mesh, tuple):
            raise TypeError(
                "device_mesh must be a tuple (replicas, shard size) for hybrid sharding, (processes,) otherwise, or a"
                f" torch DeviceMesh; got {type(device_mesh).__name__}."
            )
        if not hybrid and len(device_mesh) == 2:
            raise ValueError(
                "device_mesh is for sharding_strategy='HYBRID_SHARD' (replicas x shard size); got"
                f" sharding_strategy={self.sharding_strategy!r}."
            )
        if len(device_mesh) != dims or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in device_mesh
        ):
            expected = "a pair (replicas, shard size) of positive ints" if hybrid else "(processes,), one positive int"
            raise ValueError(f"device_mesh={device_mesh!r} must be {expected}, or a {dims}-D DeviceMesh.")
        return device_mesh

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

    def setup_environment(self) -> None:
        """Join the process group, then build the device mesh the parameters are sharded over."""
        super().setup_environment()
        self.device_mesh = self._build_mesh()
        if self.world_size == 1:
            rank_zero_info(ONE_PROCESS_NOTICE)

    def parallel_dims(self) -> ParallelDims:
        """The replicate and shard sizes: hybrid sharding replicates across ``device_mesh[0]`` groups (by default one
        per node) of ``device_mesh[1]`` shards; 'NO_SHARD' replicates on every rank; otherwise every rank shards."""
        world = self.num_nodes * self.num_processes
        spec = self._device_mesh_spec if isinstance(self._device_mesh_spec, tuple) else None
        if self.sharding_strategy in HYBRID_STRATEGIES:
            replicas, shards = spec or (self.num_nodes, self.num_processes)
            if replicas * shards != world:
                raise ValueError(
                    f"{self.sharding_strategy} device_mesh={(replicas, shards)} has {replicas * shards} processes,"
                    f" but the job has {world}; pass device_mesh=(replicas, shard_size) whose product is {world}."
                )
            return ParallelDims(world, data_replicate=replicas, data_shard=shards, axes=_HYBRID_AXES)
        if spec is not None and spec[0] != world:
            raise ValueError(f"device_mesh={spec} has {spec[0]} processes, but the job has {world}.")
        if self.sharding_strategy == "NO_SHARD":
            return ParallelDims(world, data_replicate=world, axes=_HYBRID_AXES)
        return ParallelDims(world, data_shard=world, axes=(MeshAxis.DATA_SHARD,))

    def _build_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        device_type = self.root_device.type
        hybrid = self.sharding_strategy in HYBRID_STRATEGIES
        if self._process_group is not None:
            mesh = fsdp1.mesh_from_process_group(self._process_group, hybrid, device_type, self.all_gather_object)
        elif isinstance(self._device_mesh_spec, DeviceMesh):
            mesh = self._device_mesh_spec
        else:
            return self.parallel_dims().build_mesh(device_type)
        if self.sharding_strategy == "NO_SHARD":
            # Replicated everywhere: a (processes x 1) mesh, on which fully_shard only all-reduces gradients.
            mesh = DeviceMesh(device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=_HYBRID_NAMES)
        return mesh

    # ------------------------------------------------------------------ creating and sharding the module
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``empty_init=True``: on the meta device; otherwise in host memory, where ``setup`` shards it onto the
        devices."""
        if empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        # Not on the root device: a model created whole on one GPU is what sharding exists to avoid.
        with ExitStack() as stack:
            stack.enter_context(empty_init_context(False))
            stack.enter_context(self.precision_plugin.tensor_init_context())
            yield

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around configure_model: ``torch.distributed.fsdp.wrap.wrap(layer)`` marks a layer as its own shard group, as
        in FSDP1."""
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=self._mark_for_sharding):
            yield

    def _mark_for_sharding(self, module: nn.Module, **fsdp1_arguments: Any) -> nn.Module:
        # FSDP1 would wrap the layer now; FSDP2 shards it in setup, with the strategy's settings, before the root.
        if fsdp1_arguments:
            fsdp1.warn_once(
                "wrap arguments",
                f"wrap(module, {', '.join(fsdp1_arguments)}=...): FSDP2 shards the layer with the strategy's own"
                " settings; these arguments are not applied.",
            )
        self._marked_for_sharding.append(module)
        return module

    def model_to_device(self) -> None:
        """Move what ``fully_shard`` left in place (parameters it ignores) to the device; shards are already there."""
        assert self._module is not None
        device = self.root_device
        with torch.no_grad():
            for module in self._module.modules():
                for table in (module._parameters, module._buffers):
                    for name, tensor in table.items():
                        if tensor is None or is_dtensor(tensor) or tensor.is_meta or tensor.device == device:
                            continue
                        if isinstance(tensor, nn.Parameter):
                            tensor.data = tensor.data.to(device)  # the same Parameter: tied weights stay tied
                        else:
                            table[name] = tensor.to(device)  # type: ignore[assignment]  # a buffer's table

    def prepare_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        """Shard the module in host memory (unless configure_model did), then materialise meta tensors.

        Nothing is moved whole to the device first: ``fully_shard`` moves each group's tensors as it shards them.
        """
        if not is_sharded(module):
            if settings.fitting and self._layer_sync is not None:
                # Before sharding, so that the synchronised layers' parameters are sharded like any other.
                module = self._layer_sync.apply(module)
            module = self.precision_plugin.convert_module(module)
            self._module = module  # type: ignore[assignment]  # the connected TrainingModule, converted in place
            self._broadcast_from_rank_zero(module)
            self._apply_activation_checkpointing(module)
            self._shard(module)
            self._sharded_by_strategy = module
        else:
            self._check_presharded(module)
            module = self.precision_plugin.convert_module(module)
            self._module = module  # type: ignore[assignment]  # the connected TrainingModule, converted in place
        if has_meta_tensors(module):
            self._materialize(module)
        return module

    def _check_presharded(self, module: nn.Module) -> None:
        if module is self._sharded_by_strategy:
            return
        if self._wrap_picker is not None or self._checkpoint_picker is not None:
            rank_zero_warn(
                "The module was already sharded with fully_shard in configure_model: auto_wrap_policy and"
                " activation_checkpointing_policy are ignored."
            )
        if self._layer_sync is not None:
            rank_zero_warn(
                "The module was already sharded with fully_shard in configure_model: sync_batchnorm is not applied"
                " (convert its BatchNorm layers with torch.nn.SyncBatchNorm.convert_sync_batchnorm before fully_shard)."
            )

    def _broadcast_from_rank_zero(self, module: nn.Module) -> None:
        # fully_shard keeps each rank's own slice: ranks that initialised differently would assemble a mixed model.
        # Tensors on the meta device are initialised alike on every rank later (see _materialize).
        if self.world_size == 1:
            return
        device = self.root_device
        for tensor in module.state_dict().values():
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            # One tensor at a time through the device when the backend needs it there (NCCL), never the whole model.
            staged = tensor if tensor.device == device else tensor.to(device)
            distributed.run_collective(
                "broadcast(weights)",
                self.global_rank,
                self._timeout,
                partial(torch.distributed.broadcast, staged, src=0),
            )
            if staged is not tensor:
                tensor.copy_(staged)

    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        if self._checkpoint_picker is None:
            return
        selected = self._checkpoint_picker(module)
        if not selected:
            rank_zero_warn("activation_checkpointing_policy selected no submodule: nothing is recomputed.")
        for sub in selected:
            checkpoint_activations(sub)

    def _fully_shard_arguments(self) -> dict[str, Any]:
        # ZeRO-3 without an explicit reshard_after_forward: None, torch's own default, frees every group's gathered
        # parameters after its forward but the root's, which backward needs at once (as FSDP1's FULL_SHARD does);
        # True there would gather the root's parameters twice per step.
        reshard: bool | int | None = self.reshard_after_forward
        if reshard is True and "reshard_after_forward" not in self._fully_shard_kwargs:
            reshard = None
        arguments: dict[str, Any] = {"mesh": self.device_mesh, "reshard_after_forward": reshard}
        policy = self.mixed_precision
        if policy is None and isinstance(self.precision_plugin, FSDPPrecision):
            policy = self.precision_plugin.mixed_precision_policy()
        if policy is not None:
            arguments["mp_policy"] = policy
        if self.cpu_offload:
            if self.root_device.type == "cpu":
                rank_zero_info(
                    "cpu_offload: the model already trains on the CPU, so parameters, gradients and optimizer state"
                    " stay in host memory."
                )
            else:
                from torch.distributed.fsdp import CPUOffloadPolicy

                arguments["offload_policy"] = (
                    self.cpu_offload if not isinstance(self.cpu_offload, bool) else CPUOffloadPolicy()
                )
        arguments.update(self._fully_shard_kwargs)
        return arguments

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        arguments = self._fully_shard_arguments()
        chosen = self._wrap_picker(module) if self._wrap_picker is not None else []
        marked = {id(sub) for sub in self._marked_for_sharding}
        chosen += [sub for sub in reversed(list(module.modules())) if id(sub) in marked and sub is not module]
        # Innermost first: a layer is sharded before the blocks that contain it.
        depth = {id(sub): len(name.split(".")) for name, sub in module.named_modules() if name}
        for sub in sorted(chosen, key=lambda sub: -depth[id(sub)]):
            if not isinstance(sub, FSDPModule):
                fully_shard(sub, **arguments)
        fully_shard(module, **arguments)
        self._marked_for_sharding = []

    def teardown(self) -> None:
        """Release the environment and plugins; the sharded module stays on its devices, as in the fsdp1.

        Its SyncBatchNorm layers stay too: swapping modules under fully_shard's hooks would break it for later calls.
        """
        layer_sync = self._layer_sync
        if self._module is not None and is_sharded(self._module):
            self._layer_sync = None
        try:
            super().teardown()
        finally:
            self._layer_sync = layer_sync

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'fsdp' and 'fsdp_cpu_offload'."""
        registry.register("fsdp", cls, description="Fully sharded data parallel (FSDP2), ZeRO-3 style.")
        registry.register(
            "fsdp_cpu_offload",
            cls,
            description="Fully sharded data parallel with parameters and optimizer state offloaded to the CPU.",
            cpu_offload=True,
        )
