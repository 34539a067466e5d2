"""Pipeline options of ModelParallelStrategy that need no second process: the refusals, the mesh, the stages a rank
holds, and how a batch is cut into micro-batches."""

from __future__ import annotations

import contextlib
import pickle
from collections import namedtuple
from typing import Any

import pytest
import torch

import phalanx
from phalanx.strategies import ModelParallelStrategy, RunSettings, Strategy
from phalanx.strategies.pipeline import SCHEDULES, slice_batch, stages_of_rank

CPU4 = [torch.device("cpu")] * 4


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"pipeline_schedule": "ZeroBubble"}, ValueError, r"pipeline_schedule='ZeroBubble' is not valid; choose one"),
        ({"pipeline_schedule": "Interleaved1F1B", "pipeline_stages_per_rank": 1}, ValueError, "needs pipeline_stag"),
        ({"pipeline_schedule": "LoopedBFS", "pipeline_stages_per_rank": 1}, ValueError, "runs virtual stages"),
        ({"pipeline_schedule": "1F1B", "pipeline_stages_per_rank": 2}, ValueError, "runs one stage per rank"),
        ({"pipeline_schedule": "ZBVZeroBubble", "pipeline_stages_per_rank": 3}, ValueError, "exactly 2 stages"),
        ({"pipeline_schedule": "DualPipeV", "pipeline_stages_per_rank": 3}, ValueError, "exactly 2 stages"),
        (
            {"pipeline_schedule": "DualPipeV", "pipeline_parallel_size": 2, "microbatches": 3},
            ValueError,
            r"'DualPipeV' needs microbatches >= its 4 stages, got 3",
        ),
        ({"microbatches": 0}, ValueError, r"microbatches=0 must be an int >= 1"),
        ({"microbatches": True}, ValueError, r"microbatches=True must be an int >= 1"),
        ({"pipeline_parallel_size": 0}, ValueError, r"pipeline_parallel_size=0 must be an int >= 1"),
        ({"pipeline_parallel_size": 2.0}, ValueError, r"pipeline_parallel_size=2.0 must be an int >= 1"),
        (
            {"pipeline_parallel_size": 2, "save_distributed_checkpoint": False},
            ValueError,
            r"pipeline_parallel_size=2 needs save_distributed_checkpoint=True",
        ),
    ],
    ids=lambda value: str(value)[:40],
)
def test_invalid_pipeline_options_are_refused_at_construction(options, error, message):
    with pytest.raises(error, match=message):
        ModelParallelStrategy(**options)


def test_an_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError) as raised:
        ModelParallelStrategy(pipeline_schedule="1f1b")
    assert all(repr(name) in str(raised.value) for name in SCHEDULES)


@pytest.mark.parametrize(
    ("pp", "dp", "tp", "devices", "message"),
    [
        (2, 2, "auto", 2, r"pipeline_parallel_size=2 x data_parallel_size=2 x tensor_parallel_size='auto' must equal"),
        (3, "auto", "auto", 4, r"pipeline_parallel_size=3 x data_parallel_size='auto'"),
        (2, 1, 1, 4, r"must equal the number of processes \(4 = devices 4 x num_nodes 1\)"),
    ],
)
def test_sizes_that_do_not_multiply_to_the_world_size_are_refused_once_it_is_known(pp, dp, tp, devices, message):
    strategy = ModelParallelStrategy(
        pipeline_parallel_size=pp, data_parallel_size=dp, tensor_parallel_size=tp, parallel_devices=CPU4[:devices]
    )
    with pytest.raises(ValueError, match=message):
        strategy.parallel_dims()


@pytest.mark.parametrize(
    ("pp", "dp", "tp", "shape", "samplers"),
    [
        (2, "auto", "auto", (2, 2, 1), [(2, 0), (2, 1), (2, 0), (2, 1)]),
        (4, "auto", "auto", (4, 1, 1), [(1, 0)] * 4),
        (2, 1, 2, (2, 1, 2), [(1, 0)] * 4),
        (1, 2, 2, (2, 2), [(2, 0), (2, 0), (2, 1), (2, 1)]),  # no pipeline: the 2-D mesh as before
    ],
)
def test_the_mesh_gains_the_pipeline_axis_and_stages_read_the_same_data(pp, dp, tp, shape, samplers):
    strategy = ModelParallelStrategy(
        pipeline_parallel_size=pp, data_parallel_size=dp, tensor_parallel_size=tp, parallel_devices=CPU4
    )
    dims = strategy.parallel_dims()
    assert dims.shape == shape
    assert [axis.value for axis in dims.axes][-2:] == ["data_parallel", "tensor_parallel"]
    assert (dims.axes[0].value == "pipeline_parallel") == (pp > 1)
    found = [tuple(dims.sampler_kwargs(rank).values()) for rank in range(4)]
    assert found == samplers
    # The loss is on the last stage: its first rank holds the job's metrics.
    assert dims.metrics_rank == (pp - 1) * (4 // pp) if pp > 1 else dims.metrics_rank == 0


@pytest.mark.parametrize(
    ("schedule", "size", "per_rank", "expected"),
    [
        ("1F1B", 2, 1, [(0,), (1,)]),
        ("GPipe", 4, 1, [(0,), (1,), (2,), (3,)]),
        ("Interleaved1F1B", 2, 2, [(0, 2), (1, 3)]),
        ("LoopedBFS", 2, 3, [(0, 2, 4), (1, 3, 5)]),
        ("ZBVZeroBubble", 2, 2, [(0, 3), (1, 2)]),
        ("DualPipeV", 4, 2, [(0, 7), (1, 6), (2, 5), (3, 4)]),
    ],
)
def test_the_stages_each_rank_holds(schedule, size, per_rank, expected):
    found = [stages_of_rank(schedule, rank, size, per_rank) for rank in range(size)]
    assert found == expected
    assert sorted(stage for stages in found for stage in stages) == list(range(size * per_rank))


Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize(
    "batch",
    [
        (torch.arange(8.0), torch.arange(8.0) * 2),
        [torch.arange(8.0).view(8, 1), torch.tensor(3.0)],
        {"x": torch.arange(8.0), "mask": torch.ones(3), "name": "kept"},
        Pair(torch.arange(8.0), torch.arange(16.0).view(8, 2)),
    ],
    ids=["tuple", "list_with_scalar", "dict_with_other_sizes", "namedtuple"],
)
def test_a_micro_batch_cuts_every_tensor_of_the_batch_size(batch):
    part = slice_batch(batch, 2, 4, 8)
    assert type(part) is type(batch)
    values = list(part.values()) if isinstance(part, dict) else list(part)
    originals = list(batch.values()) if isinstance(batch, dict) else list(batch)
    for value, original in zip(values, originals):
        if isinstance(original, torch.Tensor) and original.dim() and original.shape[0] == 8:
            torch.testing.assert_close(value, original[2:4])
        else:
            assert value is original


@pytest.mark.parametrize(("size", "microbatches"), [(6, 4), (5, 2), (3, 4)])
def test_micro_batches_that_do_not_divide_the_batch_are_refused(size, microbatches):
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, microbatches=microbatches)
    with pytest.raises(ValueError, match=rf"microbatches={microbatches} does not divide the batch of {size} samples"):
        strategy._pipeline_inputs((torch.zeros(size, 3), torch.zeros(size)))


class _NoLoss(phalanx.TrainingModule):
    def configure_model(self) -> None:
        pass


class _Loss(_NoLoss):
    def pipeline_loss(self, output, batch):
        return output.sum()


class _Manual(_Loss):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_a_pipeline_needs_the_loss_hook_and_automatic_optimization():
    with pytest.raises(TypeError, match=r"needs _NoLoss.pipeline_loss\(output, batch\)"):
        ModelParallelStrategy(pipeline_parallel_size=2).connect(_NoLoss())
    ModelParallelStrategy().connect(_NoLoss())  # without a pipeline the hook is not needed
    strategy = ModelParallelStrategy(pipeline_parallel_size=2)
    strategy.connect(_Manual())
    with pytest.raises(ValueError, match="manual optimization is not supported"):
        strategy.check_setup(RunSettings())
    strategy.check_setup(RunSettings(stage="validate"))  # evaluation runs no optimizer


def test_a_pipeline_strategy_pickles_with_its_pipeline_options():
    # Spawned workers get the strategy pickled: the copy must still run the schedule, not the base's step.
    strategy = pickle.loads(pickle.dumps(ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="GPipe")))
    assert strategy.pipeline_parallel_size == 2 and strategy.num_pipeline_stages == 2
    assert type(strategy).forward_backward is not Strategy.forward_backward


def test_backward_outside_the_schedule_is_refused_naming_the_step_to_call():
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"cohort\.forward_backward\(batch, batch_idx\) in a Cohort loop"):
        ModelParallelStrategy(pipeline_parallel_size=2).backward(loss, None)
    assert loss.grad is None


def _plugin(precision: str, scaler: bool) -> Any:
    from phalanx.plugins.precision.fsdp import FSDPPrecision

    return FSDPPrecision(precision, "cpu", scaler=torch.amp.GradScaler("cpu") if scaler else None)


@pytest.mark.parametrize(
    ("pipeline", "precision", "scaler", "refused"),
    [
        (2, "16-mixed", True, True),  # the schedule's backward runs outside the GradScaler
        (2, "bf16-mixed", False, False),
        (2, "32-true", False, False),
        (1, "16-mixed", True, False),  # without a pipeline the scaler scales the backward as usual
    ],
)
@pytest.mark.parametrize("given", ["to the strategy", "to the Trainer"])
def test_loss_scaling_is_refused_with_a_pipeline_when_the_plugin_is_given(pipeline, precision, scaler, refused, given):
    plugin = _plugin(precision, scaler)
    with (
        pytest.raises(ValueError, match=r"GradScaler \('16-mixed'\) cannot run with pipeline_parallel_size=2")
        if (refused)
        else contextlib.nullcontext()
    ):
        if given == "to the strategy":
            strategy = ModelParallelStrategy(pipeline_parallel_size=pipeline, precision_plugin=plugin)
        else:
            strategy = ModelParallelStrategy(pipeline_parallel_size=pipeline)
            phalanx.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], logger=False)
        assert strategy.precision_plugin is plugin
