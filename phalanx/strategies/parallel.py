"""ParallelStrategy: the base of strategies that run one process per device, across one or more nodes."""

from __future__ import annotations

from abc import ABC
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.layer_sync import LayerSync
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed

_T = TypeVar("_T")


class ParallelStrategy(Strategy, ABC):
    """Ranks come from a ClusterEnvironment; collectives go through torch.distributed."""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self._num_nodes = 1
        self._layer_sync: LayerSync | None = None
        self._timeout: timedelta | None = None

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node (one per device)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layer_sync(self) -> LayerSync | None:
        """The LayerSync applied while fitting (SyncBatchNorm with ``sync_batchnorm=True``)."""
        return self._layer_sync

    @layer_sync.setter
    def layer_sync(self, layer_sync: LayerSync | None) -> None:
        self._layer_sync = layer_sync

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @property
    def node_rank(self) -> int:
        """This node's rank."""
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each process reads a disjoint shard: ``num_replicas`` = world size, ``rank`` = global rank."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: str | None = "mean") -> Tensor | Any:
        """All-reduce ``tensor`` with ``reduce_op`` ('mean', 'sum', 'max', 'min'); other values pass through."""
        if not isinstance(tensor, Tensor) or not distributed.is_initialized():
            return tensor
        return distributed.all_reduce(tensor, reduce_op or "mean", group, self.global_rank, self._timeout)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from all processes (differentiable with ``sync_grads=True``)."""
        if not distributed.is_initialized():
            return tensor
        return distributed.all_gather(tensor, group, sync_grads, self.global_rank, self._timeout)

    def all_gather_object(self, obj: _T) -> list[_T]:
        """Gather a picklable object from every process."""
        if not distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        distributed.run_collective("all_gather_object", self.global_rank, self._timeout, lambda: torch.distributed.all_gather_object(gathered, obj))
        return gathered

    def barrier(self, name: str | None = None) -> None:
        """Wait for every process."""
        if distributed.is_initialized():
            distributed.run_collective(f"barrier({name})" if name else "barrier", self.global_rank, self._timeout, torch.distributed.barrier)

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Send a picklable object from ``src`` to every process."""
        if not distributed.is_initialized():
            return obj
        box = [obj]
        distributed.run_collective("broadcast", self.global_rank, self._timeout, lambda: torch.distributed.broadcast_object_list(box, src=src))
        return box[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """True if every process (``all=True``) or any process (``all=False``) decided True."""
        if not distributed.is_initialized():
            return decision
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def block_backward_sync(self) -> AbstractContextManager:
        """Skip gradient synchronisation while accumulating, when the wrapper supports it."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None and self.model is not self.module else nullcontext()

    def reconciliate_processes(self, trace: str) -> None:
        """Called when one process failed: make sure the others do not wait for it forever."""
        launcher = self.launcher
        if launcher is not None:
            launcher.kill()

    def teardown(self) -> None:
        """Release the environment, then the device and plugins."""
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()
