"""ParallelDims: sizes inferred and checked against the world size, ranks placed as torch's DeviceMesh places them."""

from __future__ import annotations

import itertools

import pytest
import torch

from phalanx.strategies.fsdp.model_parallel import ModelParallelStrategy
from phalanx.strategies.fsdp.strategy import FSDPStrategy
from phalanx.strategies.parallel_dims import MeshAxis, ParallelDims

P, R, S, D, T = MeshAxis.PIPELINE, MeshAxis.DATA_REPLICATE, MeshAxis.DATA_SHARD, MeshAxis.DATA, MeshAxis.TENSOR


@pytest.mark.parametrize(
    ("world", "sizes", "axes", "shape", "data_parallel"),
    [
        (4, {"data_shard": -1}, (S,), (4,), 4),
        (4, {"data_replicate": 2, "data_shard": -1}, (R, S), (2, 2), 4),
        (8, {"data_replicate": -1, "data_shard": 4}, (R, S), (2, 4), 8),
        (8, {"data_shard": 2, "tensor": -1}, (D, T), (2, 4), 2),
        (8, {"pipeline": 2, "data_shard": -1, "tensor": 2}, (P, D, T), (2, 2, 2), 2),
        (6, {"pipeline": -1, "data_replicate": 3}, (P, R, S), (2, 3, 1), 3),
        (1, {}, (S,), (1,), 1),
        (3, {"data_shard": 3}, (R, S), (1, 3), 3),
    ],
)
def test_one_degree_is_inferred_and_the_shape_follows_the_axes(world, sizes, axes, shape, data_parallel):
    dims = ParallelDims(world, axes=axes, **sizes)
    assert dims.shape == shape
    assert dims.data_parallel_size == data_parallel
    assert dims.pipeline * dims.data_replicate * dims.data_shard * dims.tensor == world


@pytest.mark.parametrize(
    ("world", "sizes", "axes", "message"),
    [
        (4, {"data_shard": 3}, (S,), "The world size 4 is not their product 3"),
        (4, {"data_shard": -1, "tensor": 3}, (D, T), "cannot be divided by the other sizes' product 3"),
        (4, {"data_shard": -1, "tensor": -1}, (D, T), "Only one of pipeline, data_replicate, data_shard, tensor"),
        (4, {"data_shard": 0}, (S,), "data_shard=0 must be an int >= 1, or -1"),
        (4, {"tensor": True}, (T,), "tensor=True must be an int >= 1"),
        (4, {"tensor": 4}, (S,), "tensor=4 needs the axis 'tensor_parallel'"),
        (4, {"pipeline": 4}, (S,), "pipeline=4 needs the axis 'pipeline_parallel'"),
        (4, {"data_replicate": 4}, (S,), "data_replicate=4 needs the axis 'replicate'"),
        (4, {"data_shard": 4}, (T,), "data_shard=4 needs the axis 'shard'"),
        (4, {"data_shard": 4}, (D, S), "already holds the 'replicate' and 'shard' ranks"),
        (4, {"data_shard": 4}, (S, S), "names an axis twice"),
        (4, {"data_shard": 4}, (), "at least one axis"),
        (0, {}, (S,), "world_size=0 must be an int >= 1"),
        (4, {"data_shard": 4}, ("sharded",), "'sharded' is not a valid MeshAxis"),
    ],
)
def test_invalid_layouts_are_refused_naming_the_sizes(world, sizes, axes, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(world, axes=axes, **sizes)


LAYOUTS = [
    ParallelDims(4, data_replicate=2, data_shard=2, axes=(R, S)),
    ParallelDims(8, data_shard=2, tensor=4, axes=(D, T)),
    ParallelDims(8, pipeline=2, data_shard=2, tensor=2, axes=(P, D, T)),
    ParallelDims(12, pipeline=3, data_replicate=2, data_shard=2, axes=(P, R, S)),
    ParallelDims(6, pipeline=2, data_shard=3, axes=(P, D)),
]


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda dims: "x".join(map(str, dims.shape)))
def test_ranks_sit_where_torch_lays_them_out(dims):
    # init_device_mesh arranges arange(world) row-major over the shape: the oracle for every coordinate.
    grid = torch.arange(dims.world_size).view(dims.shape)
    data_axes = [i for i, axis in enumerate(dims.axes) if axis in (R, S, D)]
    data_shape = [dims.shape[i] for i in data_axes]
    for index in itertools.product(*(range(n) for n in dims.shape)):
        rank = int(grid[index])
        assert [dims.coordinates(rank)[axis] for axis in dims.axes] == list(index)
        data_index = [index[i] for i in data_axes]
        expected = int(torch.arange(dims.data_parallel_size).view(data_shape)[tuple(data_index)])
        assert dims.sampler_kwargs(rank) == {"num_replicas": dims.data_parallel_size, "rank": expected}


@pytest.mark.parametrize(
    ("dims", "rank"),
    [(LAYOUTS[0], 0), (LAYOUTS[1], 0), (LAYOUTS[2], 4), (LAYOUTS[3], 8), (LAYOUTS[4], 3)],
)
def test_the_metrics_rank_is_the_first_of_the_last_stage(dims, rank):
    assert dims.metrics_rank == rank
    if P in dims.axes:
        assert dims.coordinates(rank)[P] == dims.pipeline - 1
        assert all(value == 0 for axis, value in dims.coordinates(rank).items() if axis is not P)


def test_ranks_outside_the_job_are_refused():
    with pytest.raises(ValueError, match="rank=4 is outside the job's ranks 0..3"):
        LAYOUTS[0].coordinates(4)


def test_the_object_is_frozen_and_axes_can_be_replaced():
    dims = LAYOUTS[0]
    with pytest.raises(AttributeError):
        dims.data_shard = 4  # type: ignore[misc]
    assert dims.with_axes(D).shape == (4,)
    with pytest.raises(ValueError, match="data_replicate=2 needs the axis 'replicate'"):
        dims.with_axes(S)


def _devices(n: int) -> list[torch.device]:
    return [torch.device("cpu")] * n


@pytest.mark.parametrize(
    ("arguments", "sizes"),
    [
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}, (2, 2)),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": (4, 1)}, (4, 1)),
        ({"sharding_strategy": "HYBRID_SHARD"}, (1, 4)),  # one node: one replica of four shards
        ({"sharding_strategy": "NO_SHARD"}, (4, 1)),
        ({}, (1, 4)),
    ],
)
def test_fsdp_states_its_replicate_and_shard_sizes(arguments, sizes):
    strategy = FSDPStrategy(parallel_devices=_devices(4), **arguments)
    dims = strategy.parallel_dims()
    assert (dims.data_replicate, dims.data_shard) == sizes
    assert dims.data_parallel_size == 4


def test_fsdp_refuses_a_hybrid_mesh_that_is_not_the_world():
    strategy = FSDPStrategy(parallel_devices=_devices(4), sharding_strategy="HYBRID_SHARD", device_mesh=(2, 3))
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 3\) has 6 processes, but the job has 4"):
        strategy.parallel_dims()


@pytest.mark.parametrize(
    ("dp", "tp", "rank", "sampler"),
    [(2, 2, 3, {"num_replicas": 2, "rank": 1}), (4, 1, 2, {"num_replicas": 4, "rank": 2}), (1, 4, 3, None)],
)
def test_model_parallel_reads_its_mesh_from_the_dims(dp, tp, rank, sampler):
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, parallel_devices=_devices(4))
    dims = strategy.parallel_dims()
    assert dims.axes == (D, T) and dims.shape == (dp, tp)
    assert dims.sampler_kwargs(rank) == (sampler or {"num_replicas": 1, "rank": 0})


def test_the_strategy_contract_declares_a_device_mesh():
    from phalanx.strategies.single_device import SingleDeviceStrategy

    assert SingleDeviceStrategy(torch.device("cpu")).device_mesh is None
    with pytest.raises(RuntimeError, match="built when the processes join their group"):
        ModelParallelStrategy(parallel_devices=_devices(2)).device_mesh  # noqa: B018 - the read is the test
