"""ParallelDims: one description of how a job's processes divide into pipeline, data and tensor parallel groups.

A strategy states the sizes once (one of them may be ``-1``, inferred from the world size) and the axes of its mesh;
the object checks that the sizes multiply to the world size, builds the ``DeviceMesh`` with the axis names of
:class:`MeshAxis`, and answers the rank questions (which data-parallel replica a rank reads for, which rank holds
the metrics) by arithmetic, before any process group exists. Ranks are laid out row-major over the mesh's axes, as
``torch.distributed.device_mesh.init_device_mesh`` lays them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class MeshAxis(str, Enum):
    """The names of a mesh's axes; a strategy's mesh uses a subset of them, outermost first."""

    #: Pipeline stages (outermost: stage neighbours exchange activations, the least frequent traffic).
    PIPELINE = "pipeline_parallel"
    #: Replicas of one sharded model (hybrid sharding: gradients all-reduced across them).
    DATA_REPLICATE = "replicate"
    #: Ranks that share one model's parameters, gradients and optimizer state (FSDP's shard group).
    DATA_SHARD = "shard"
    #: All data-parallel ranks as one axis (replicate x shard), as ``ModelParallelStrategy`` names it (Lightning's).
    DATA = "data_parallel"
    #: Ranks that split each layer's tensors (innermost: the most frequent traffic).
    TENSOR = "tensor_parallel"


#: Axes that hold data-parallel ranks (their coordinates together give the rank a sampler reads for).
_DATA_AXES = (MeshAxis.DATA_REPLICATE, MeshAxis.DATA_SHARD, MeshAxis.DATA)
_SIZE_NAMES = ("pipeline", "data_replicate", "data_shard", "tensor")


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{name}={value!r} must be an int >= 1, or -1 to infer it from the world size.")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions of a job of ``world_size`` processes, and the axes its mesh has.

    One of ``pipeline``, ``data_replicate``, ``data_shard`` and ``tensor`` may be ``-1``: it is the world size
    divided by the others. ``axes`` lists the mesh's axes outermost first; an axis left out must have size 1, and
    :attr:`MeshAxis.DATA` stands for ``data_replicate x data_shard`` (it cannot appear beside either of them).
    """

    world_size: int
    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    tensor: int = 1
    axes: tuple[MeshAxis, ...] = field(default=(MeshAxis.DATA_SHARD,))

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an int >= 1.")
        for name in _SIZE_NAMES:
            _check_degree(name, getattr(self, name))
        object.__setattr__(self, "axes", tuple(MeshAxis(axis) for axis in self.axes))
        self._check_axes()
        inferred = [name for name in _SIZE_NAMES if getattr(self, name) == -1]
        if len(inferred) > 1:
            raise ValueError(f"Only one of {', '.join(_SIZE_NAMES)} may be -1; got -1 for {', '.join(inferred)}.")
        known = math.prod(getattr(self, name) for name in _SIZE_NAMES if name not in inferred)
        if inferred:
            if self.world_size % known:
                raise ValueError(self._mismatch(f"cannot be divided by the other sizes' product {known}"))
            object.__setattr__(self, inferred[0], self.world_size // known)
        elif known != self.world_size:
            raise ValueError(self._mismatch(f"is not their product {known}"))
        for name, axis in (("pipeline", MeshAxis.PIPELINE), ("tensor", MeshAxis.TENSOR)):
            if getattr(self, name) > 1 and axis not in self.axes:
                raise ValueError(f"{name}={getattr(self, name)} needs the axis {axis.value!r} in the mesh's axes.")
        if self.data_replicate > 1 and MeshAxis.DATA_REPLICATE not in self.axes and MeshAxis.DATA not in self.axes:
            raise ValueError(f"data_replicate={self.data_replicate} needs the axis 'replicate' in the mesh's axes.")
        if self.data_shard > 1 and MeshAxis.DATA_SHARD not in self.axes and MeshAxis.DATA not in self.axes:
            raise ValueError(f"data_shard={self.data_shard} needs the axis 'shard' in the mesh's axes.")

    def _check_axes(self) -> None:
        if not self.axes:
            raise ValueError(f"A mesh needs at least one axis; choose from {[axis.value for axis in MeshAxis]}.")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"axes={[axis.value for axis in self.axes]} names an axis twice.")
        if MeshAxis.DATA in self.axes and {MeshAxis.DATA_REPLICATE, MeshAxis.DATA_SHARD} & set(self.axes):
            raise ValueError(
                "The axis 'data_parallel' already holds the 'replicate' and 'shard' ranks; use it or those two."
            )

    def _mismatch(self, reason: str) -> str:
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZE_NAMES)
        return f"The world size {self.world_size} {reason} ({sizes})."

    # ------------------------------------------------------------------ sizes
    def size(self, axis: MeshAxis | str) -> int:
        """The number of ranks along ``axis``."""
        axis = MeshAxis(axis)
        if axis is MeshAxis.DATA:
            return self.data_replicate * self.data_shard
        return {
            MeshAxis.PIPELINE: self.pipeline,
            MeshAxis.DATA_REPLICATE: self.data_replicate,
            MeshAxis.DATA_SHARD: self.data_shard,
            MeshAxis.TENSOR: self.tensor,
        }[axis]

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, one size per axis of ``axes``."""
        return tuple(self.size(axis) for axis in self.axes)

    @property
    def data_parallel_size(self) -> int:
        """How many replicas read different data (``data_replicate x data_shard``)."""
        return self.data_replicate * self.data_shard

    # ------------------------------------------------------------------ ranks
    def coordinates(self, rank: int) -> dict[MeshAxis, int]:
        """``rank``'s index along each axis of the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the job's ranks 0..{self.world_size - 1}.")
        found: dict[MeshAxis, int] = {}
        for axis, size in zip(reversed(self.axes), reversed(self.shape)):
            rank, found[axis] = divmod(rank, size)
        return found

    def data_parallel_rank(self, rank: int) -> int:
        """Which of the data-parallel replicas ``rank`` reads for (ranks of one model's pipeline and tensor groups
        read the same batches)."""
        coordinates = self.coordinates(rank)
        index = 0
        for axis in self.axes:
            if axis in _DATA_AXES:
                index = index * self.size(axis) + coordinates[axis]
        return index

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank`` for ``rank``."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank(rank)}

    @property
    def metrics_rank(self) -> int:
        """The rank whose metrics stand for the job: the first rank of the last pipeline stage (where the loss is)."""
        if MeshAxis.PIPELINE not in self.axes:
            return 0
        inner = math.prod(self.shape[self.axes.index(MeshAxis.PIPELINE) + 1 :])
        return (self.pipeline - 1) * inner

    def with_axes(self, *axes: MeshAxis) -> ParallelDims:
        """The same sizes on a mesh with other axes (checked again)."""
        return replace(self, axes=axes)

    # ------------------------------------------------------------------ the mesh
    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` of the job (the process group must exist), its axes named by :class:`MeshAxis`."""
        # Lazy for import time: torch.distributed's mesh module is loaded only by jobs that build a mesh.
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=tuple(axis.value for axis in self.axes))
