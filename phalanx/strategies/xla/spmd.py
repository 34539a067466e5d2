"""XLASPMDStrategy ("xla_spmd", "xla_spmd_dp"): one process drives every XLA device through sharding annotations.

torch_xla's SPMD mode compiles one program for a device mesh: the batch is split along the mesh's ``data`` axis, and
with ``parameter_sharding="fsdp"`` (the default) each parameter is split along its first evenly divisible dimension,
so gradients and optimizer states are sharded as well (FSDP-style, as torch_xla's FSDPv2). The compiler inserts the
collectives. There is one process and one thread: no launcher, no replica copies, no per-replica collectives; the
driver feeds the global batch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.xla import import_torch_xla
from phalanx.plugins.environments.xla import XLAEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.xla._common import XLAParallelDevices, XLAStrategyMixin, refuse_compile
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.distributed import normalize_reduce_op
from phalanx.utilities.rank_zero import set_global_rank
from phalanx.utilities.registry import Registry

_T = TypeVar("_T")
PARAMETER_SHARDINGS = ("fsdp", "replicated")
MESH_AXIS = "data"


def partition_spec(shape: torch.Size, parts: int) -> tuple[str | None, ...]:
    """Split the first dimension of ``shape`` that ``parts`` divides along the mesh axis; replicate the others."""
    spec: list[str | None] = [None] * len(shape)
    for dim, size in enumerate(shape):
        if size >= parts and size % parts == 0:
            spec[dim] = MESH_AXIS
            break
    return tuple(spec)


class XLASPMDStrategy(XLAParallelDevices, XLAStrategyMixin, ParallelStrategy):
    """One process, every local XLA device, one compiled SPMD program: data parallel, parameters sharded (or not).

    Args:
        parameter_sharding: 'fsdp' (default) splits each parameter over the devices (along its first dimension that
            the device count divides; others stay whole), 'replicated' keeps a whole copy on each device (plain data
            parallel).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        parameter_sharding: str = "fsdp",
    ) -> None:
        if parameter_sharding not in PARAMETER_SHARDINGS:
            raise ValueError(
                f"XLASPMDStrategy(parameter_sharding={parameter_sharding!r}) is not valid; choose one of"
                f" {list(PARAMETER_SHARDINGS)}."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=XLAEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            timeout=None,
        )
        self._parameter_sharding = parameter_sharding
        self._mesh: Any = None

    @property
    def parameter_sharding(self) -> str:
        """'fsdp' or 'replicated'."""
        return self._parameter_sharding

    @property
    def mesh(self) -> Any:
        """torch_xla's 1-D device mesh (axis 'data'), made by ``setup_environment``."""
        return self._mesh

    # ------------------------------------------------------------------ one process
    @property
    def launcher(self) -> Any:
        """None: the one process drives every device."""
        return None

    @property
    def root_device(self) -> torch.device:
        """torch_xla's virtual SPMD device."""
        return torch.device("xla", 0)

    @property
    def world_size(self) -> int:
        """One process."""
        return 1

    @property
    def global_rank(self) -> int:
        """Rank 0."""
        return 0

    @property
    def local_rank(self) -> int:
        """Rank 0."""
        return 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """None: the process reads the global batch, which the mesh splits."""
        return None

    def record_global_rank(self) -> None:
        """One process: rank 0 of 1."""
        set_global_rank(0)

    def setup_environment(self) -> None:
        """Switch torch_xla to SPMD and build the mesh over every device (it must cover all of them)."""
        import numpy as np

        import_torch_xla()
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        count = xr.global_runtime_device_count()
        wanted = len(self.parallel_devices or [])
        if wanted != count:
            raise ValueError(
                f"XLASPMDStrategy drives every XLA device in one program: devices={wanted} but the runtime has {count}."
                " Pass devices='auto', or make fewer devices visible (CPU_NUM_DEVICES, TPU_VISIBLE_CHIPS)."
            )
        self._mesh = xs.Mesh(np.arange(count), (count,), (MESH_AXIS,))
        set_global_rank(0)
        Strategy.setup_environment(self)

    # ------------------------------------------------------------------ set-up
    def check_setup(self, settings: RunSettings) -> None:
        """Refuse a layer sync: the compiler computes statistics over the global batch already."""
        refuse_compile(self, settings)
        if self.layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True is not supported by XLASPMDStrategy: batch statistics are computed over the global"
                " batch already (the compiler shards the computation)."
            )

    def place_module(self, settings: RunSettings) -> None:
        """Move the module to the device, then shard its parameters (with 'fsdp')."""
        self.model_to_device()
        self.shard_parameters()

    def shard_parameters(self) -> None:
        """Annotate each parameter with its sharding ('fsdp'), or leave it whole on every device ('replicated')."""
        if self._parameter_sharding != "fsdp":
            return
        import torch_xla.distributed.spmd as xs

        assert self._module is not None and self._mesh is not None
        parts = int(self._mesh.size())
        for parameter in self._module.parameters():
            spec = partition_spec(parameter.shape, parts)
            if any(spec):
                xs.mark_sharding(parameter, self._mesh, spec)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch to the device and split every tensor's first dimension over the mesh (when it divides)."""
        import torch_xla.distributed.spmd as xs

        batch = super().batch_to_device(batch, device, dataloader_idx)
        parts = int(self._mesh.size())

        def shard(tensor: Tensor) -> Tensor:
            if tensor.dim() > 0 and tensor.shape[0] % parts == 0 and tensor.device.type == "xla":
                xs.mark_sharding(tensor, self._mesh, (MESH_AXIS,) + (None,) * (tensor.dim() - 1))
            return tensor

        return apply_to_tensors(batch, shard)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load whole CPU weights into the sharded parameters (each device keeps its own part)."""
        super().load_model_state_dict(checkpoint, strict=strict)
        self.shard_parameters()

    # ------------------------------------------------------------------ collectives: one process
    def naming_collectives(self, phase: str) -> AbstractContextManager:
        """The compiler's collectives run inside the program; nothing to name."""
        return nullcontext()

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: str | None = "mean") -> Tensor | Any:
        """One process: the value itself (``reduce_op`` is still checked)."""
        normalize_reduce_op(reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """One process: the tensor itself."""
        return tensor

    def all_gather_object(self, obj: _T) -> list[_T]:
        """One process: ``[obj]``."""
        return [obj]

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """One process: ``obj``."""
        return obj

    def barrier(self, name: str | None = None) -> None:
        """One process: nothing to wait for."""

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """One process: the decision."""
        return decision

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register "xla_spmd" (parameters sharded) and "xla_spmd_dp" (parameters replicated)."""
        registry.register(
            "xla_spmd",
            cls,
            description="torch_xla SPMD: one process, batch split and parameters sharded over every XLA device.",
        )
        registry.register(
            "xla_spmd_dp",
            cls,
            description="torch_xla SPMD, data parallel only: parameters replicated on every XLA device.",
            parameter_sharding="replicated",
        )


__all__ = ["PARAMETER_SHARDINGS", "XLASPMDStrategy", "partition_spec"]
