"""XLAStrategy ("xla", "xla_debug"): data parallel over XLA devices, one replica per device, via torch_xla's launcher.

Each replica holds the whole model; gradients are averaged by an all-reduce inside the step's graph
(``xm.reduce_gradients``) before the update and the hooks that precede it (clipping sees averaged gradients). On a TPU
host the launcher starts one process per chip; on the PJRT CPU runtime it starts one process with one thread per
device (see ``xla/launcher.py`` for what that means for the objects each replica uses).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.environments.xla import XLAEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.xla import _collectives as collectives
from phalanx.strategies.xla._common import (
    XLAParallelDevices,
    XLAStrategyMixin,
    holds_xla_tensors,
    refuse_compile,
    to_cpu,
)
from phalanx.strategies.xla.launcher import XLA_START_METHODS, XLALauncher
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.distributed import normalize_reduce_op
from phalanx.utilities.rank_zero import set_global_rank
from phalanx.utilities.registry import Registry

_T = TypeVar("_T")


class XLAStrategy(XLAParallelDevices, XLAStrategyMixin, ParallelStrategy):
    """One replica per XLA device; gradients all-reduced in the step's graph; checkpoints written by rank 0.

    Args:
        sync_module_states: broadcast rank 0's parameters and buffers to every replica at set-up (replicas that
            build or initialise layers themselves, e.g. in ``configure_model``, then start equal).
        debug: run with torch_xla's debug output (``PT_XLA_DEBUG_LEVEL=2``: compilations and transfers explained).
        start_method: how torch_xla's launcher starts its process: 'spawn' (default) or 'fork' (notebooks; only
            before any backward pass ran in the launching process, whose autograd engine does not survive a fork).
        timeout: how long replicas that are threads of one process (the CPU runtime) wait for each other at a graph
            cut before the run fails.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        cluster_environment: ClusterEnvironment | None = None,
        sync_module_states: bool = True,
        debug: bool = False,
        start_method: str = "spawn",
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        for name, value in (("sync_module_states", sync_module_states), ("debug", debug)):
            if not isinstance(value, bool):
                raise TypeError(f"XLAStrategy({name}={value!r}) must be True or False.")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise TypeError(f"XLAStrategy(timeout={timeout!r}) must be a positive datetime.timedelta.")
        if start_method not in XLA_START_METHODS:
            raise ValueError(
                f"XLAStrategy(start_method={start_method!r}) is not valid; choose one of {list(XLA_START_METHODS)}."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment if cluster_environment is not None else XLAEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            timeout=None,
        )
        self._sync_module_states = sync_module_states
        self._debug = debug
        self._xla_start_method = start_method
        self._replica_timeout = timeout
        self._launched = False

    # ------------------------------------------------------------------ replicas and devices
    @property
    def launcher(self) -> Any:
        """torch_xla's launcher (none inside a replica)."""
        if self._launcher is None and not self._launched:
            self._launcher = XLALauncher(self, start_method=self._xla_start_method)
        return self._launcher

    @property
    def root_device(self) -> torch.device:
        """This replica's device (before the launch: the first of ``parallel_devices``)."""
        if self._launched:
            import torch_xla

            return torch_xla.device()
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices"
        return self.parallel_devices[0]

    @property
    def replica_timeout(self) -> timedelta:
        """How long replica threads of one process wait for each other at a graph cut before giving up."""
        return self._replica_timeout

    @property
    def debug(self) -> bool:
        """Whether torch_xla's debug output is on."""
        return self._debug

    def launch_environment(self) -> dict[str, str]:
        """Variables the launcher sets for the replicas' process."""
        return {"PT_XLA_DEBUG_LEVEL": "2"} if self._debug else {}

    def record_global_rank(self) -> None:
        """Before the launch this process stands for rank 0 of ``num_processes`` replicas."""
        assert self.cluster_environment is not None
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        super().record_global_rank()

    def setup_environment(self) -> None:
        """Take this replica's ranks from the runtime and make its device the thread's default (no process group)."""
        environment = self.cluster_environment
        if self._launched and isinstance(environment, XLAEnvironment):
            environment.read_runtime()
        set_global_rank(self.global_rank)
        Strategy.setup_environment(self)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each replica reads a disjoint shard."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ set-up and steps
    def check_setup(self, settings: RunSettings) -> None:
        """Refuse a layer sync: it needs a torch.distributed process group."""
        refuse_compile(self, settings)
        if self.layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True (or a LayerSync plugin) is not supported by XLAStrategy: torch's SyncBatchNorm"
                " needs a torch.distributed process group. Remove it, or normalise with the local batch's statistics."
            )

    def place_module(self, settings: RunSettings) -> None:
        """Move the module to the device, then make the replicas equal."""
        self.model_to_device()
        if self._sync_module_states and self.world_size > 1:
            self._broadcast_module_states()

    def _broadcast_module_states(self) -> None:
        import torch_xla.core.xla_model as xm

        assert self._module is not None
        tensors = [*self._module.parameters(), *self._module.buffers()]
        if tensors:
            with torch.no_grad():
                xm.collective_broadcast(tensors, root_ordinal=0, pin_layout=False)
            collectives.cut_graph(keep_generator=True)

    def _before_optimizer_step(self) -> Callable[[Optimizer], None] | None:
        hooks = super()._before_optimizer_step()
        if self.world_size == 1:
            return hooks

        def average_gradients_then_hooks(optimizer: Optimizer) -> None:
            # In the step's graph (no cut here): the update and the hooks see averaged gradients.
            collectives.average_gradients(getattr(optimizer, "optimizer", optimizer))
            if hooks is not None:
                hooks(optimizer)

        return average_gradients_then_hooks

    def naming_collectives(self, phase: str) -> AbstractContextManager:
        """XLA collectives run inside compiled graphs; torch.distributed's error naming does not apply."""
        return nullcontext()

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: str | None = "mean") -> Tensor | Any:
        """All-reduce ``tensor`` over the replicas ('mean', 'sum', 'max', 'min'); other values pass through."""
        name = normalize_reduce_op(reduce_op)
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        return collectives.all_reduce(tensor, name, self.root_device)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every replica along a new first dimension (differentiable with ``sync_grads``)."""
        if self.world_size == 1:
            return tensor
        if sync_grads:
            return collectives.all_gather_with_gradients(tensor, self.root_device)
        return collectives.all_gather(tensor, self.root_device)

    def all_gather_object(self, obj: _T) -> list[_T]:
        """Gather a picklable object from every replica."""
        if self.world_size == 1:
            return [obj]
        return self._exchange(obj)

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Send a picklable object (or a tensor) from replica ``src`` to every replica."""
        if self.world_size == 1:
            return obj
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast(src={src}) must be a replica rank in [0, {self.world_size - 1}].")
        return self._exchange(obj)[src]

    def _exchange(self, obj: Any) -> list[Any]:
        # Tensors travel as CPU copies inside the pickle; XLA tensors come back on this replica's device.
        gathered = collectives.all_gather_object(to_cpu(obj), self.root_device)
        if not holds_xla_tensors(obj):
            return gathered
        return [apply_to_tensors(item, lambda t: t.to(self.root_device)) for item in gathered]

    def barrier(self, name: str | None = None) -> None:
        """Wait for every replica."""
        if self.world_size > 1:
            collectives.barrier(self.root_device)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """True if every replica (``all=True``) or any replica (``all=False``) decided True."""
        if self.world_size == 1:
            return decision
        votes = int(collectives.all_reduce(torch.tensor([int(decision)]), "sum", self.root_device).item())
        return votes == self.world_size if all else votes > 0

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register "xla" and "xla_debug"."""
        registry.register("xla", cls, description="Data parallel over XLA devices through torch_xla's launcher.")
        registry.register(
            "xla_debug", cls, description="'xla' with torch_xla's debug output (PT_XLA_DEBUG_LEVEL=2).", debug=True
        )


__all__ = ["XLAStrategy"]
