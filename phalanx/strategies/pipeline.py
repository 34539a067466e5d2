"""Pipeline parallelism on ``torch.distributed.pipelining``: the schedules by name, the option checks, and one rank's
stages and schedules, run for a training step (forward and backward) or forward only.

phalanx writes no schedule and no transport: :class:`PipelineRunner` builds ``PipelineStage`` objects around the
modules a rank holds and drives the package's schedule classes with whole batches.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

#: The schedules ``ModelParallelStrategy(pipeline_schedule=...)`` accepts, by our name: the class in
#: ``torch.distributed.pipelining``, and whether each rank holds several (virtual) stages.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "GPipe": ("ScheduleGPipe", False),
    "1F1B": ("Schedule1F1B", False),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", True),
    "LoopedBFS": ("ScheduleLoopedBFS", True),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", True),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", True),
    "DualPipeV": ("ScheduleDualPipeV", True),
}
#: Schedules whose two stages per rank are placed in a V (rank r holds stages r and 2 * size - 1 - r).
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})


def check_pipeline_options(schedule: Any, microbatches: Any, stages_per_rank: Any) -> None:
    """Refuse an unknown schedule, a micro-batch count below 1, and a stage count the schedule cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not valid; choose one of {list(SCHEDULES)}.")
    for name, value in (("microbatches", microbatches), ("pipeline_stages_per_rank", stages_per_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 (or None for the default).")
    multi = SCHEDULES[schedule][1]
    if stages_per_rank is None:
        return
    if multi and stages_per_rank < 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs virtual stages: it needs pipeline_stages_per_rank >= 2, got"
            f" {stages_per_rank}. Use 'GPipe' or '1F1B' for one stage per rank."
        )
    if not multi and stages_per_rank != 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs one stage per rank, got pipeline_stages_per_rank={stages_per_rank}."
            f" Choose one of {[name for name, (_, several) in SCHEDULES.items() if several]} for virtual stages."
        )
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(f"pipeline_schedule={schedule!r} places exactly 2 stages per rank, got {stages_per_rank}.")


def stages_of_rank(schedule: str, pipeline_rank: int, pipeline_size: int, stages_per_rank: int) -> tuple[int, ...]:
    """The stage indices the rank at ``pipeline_rank`` holds: looped (r, r + size, ...) or, for V schedules, (r,
    2 * size - 1 - r)."""
    if schedule in V_SCHEDULES:
        return (pipeline_rank, 2 * pipeline_size - 1 - pipeline_rank)
    return tuple(pipeline_rank + k * pipeline_size for k in range(stages_per_rank))


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """The samples ``start:stop`` of ``batch``: every tensor whose first dimension is the batch's ``size`` is cut."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)({key: slice_batch(value, start, stop, size) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(value, start, stop, size) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(value, start, stop, size) for value in batch)
    return batch


_STAGE_CLASS: list[type] = []


def _stage_class() -> type:
    """``PipelineStage``, except that a rank's two adjacent stages of a V schedule hand no gradients to each other when
    the schedule runs forward only: torch 2.13's ``eval`` of ``ZBVZeroBubble`` and ``DualPipeV`` still runs that
    hand-over, and fails on it ("can't steal_bwd_input if this stage doesn't have backward")."""
    if not _STAGE_CLASS:
        # Lazy for import time: the pipelining package loads only in jobs that run a pipeline.
        from torch.distributed.pipelining import PipelineStage

        class ForwardOnlySafeStage(PipelineStage):
            def get_local_bwd_output(self, mb_index: int) -> Any:
                return super().get_local_bwd_output(mb_index) if self.has_backward else ()

            def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
                if self.has_backward:
                    super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        _STAGE_CLASS.append(ForwardOnlySafeStage)
    return _STAGE_CLASS[0]


def _signature(inputs: tuple[Tensor, ...]) -> tuple[Any, ...]:
    return tuple((tuple(value.shape), value.dtype) for value in inputs)


class PipelineRunner:
    """One rank's part of a pipeline: its stage modules, and the schedules that run them (built at the first batch
    of each input shape, since a stage learns the shapes it exchanges then)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_indices: Sequence[int],
        num_stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        microbatches: int,
    ) -> None:
        self.modules = list(modules)
        self.stage_indices = tuple(stage_indices)
        self.num_stages = num_stages
        self.device = device
        self.group = group
        self.schedule_name = schedule
        self.microbatches = microbatches
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._loss_fn: Callable[[Any, Tensor], Tensor] | None = None

    @property
    def holds_first(self) -> bool:
        """Whether this rank holds the first stage (which reads the input)."""
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (which computes the loss and the output)."""
        return self.num_stages - 1 in self.stage_indices

    def _schedule(self, key: tuple[Any, ...], name: str, microbatches: int, loss_fn: Callable | None) -> Any:
        schedule = self._schedules.get(key)
        if schedule is None:
            # Lazy for import time: the pipelining package loads only in jobs that run a pipeline.
            from torch.distributed import pipelining

            stages = [
                _stage_class()(module, index, self.num_stages, self.device, group=self.group)
                for module, index in zip(self.modules, self.stage_indices)
            ]
            cls = getattr(pipelining, SCHEDULES[name][0])
            # scale_grads=False: the schedule would divide every gradient by the micro-batch count after each step,
            # gradients accumulated over earlier batches too; the loss is divided instead (see ``train``).
            stage = stages if SCHEDULES[name][1] else stages[0]
            schedule = cls(stage, microbatches, loss_fn=loss_fn, scale_grads=False)
            self._schedules[key] = schedule
        return schedule

    def train(self, inputs: tuple[Tensor, ...], batch_size: int, loss_fn: Callable[[Any, Tensor], Tensor]) -> Tensor:
        """Run forward and backward over the batch in micro-batches; on the rank that holds the last stage, the sum of
        the losses backpropagated (a zero elsewhere). ``loss_fn(output, indices)`` gets a micro-batch's sample indices
        and returns what to backpropagate for it (its share of the batch's loss)."""
        self._loss_fn = loss_fn
        schedule = self._schedule(
            ("train", *_signature(inputs)),
            self.schedule_name,
            self.microbatches,
            # The schedule keeps the function it was built with: each step's batch reaches it through this attribute.
            lambda output, indices: self._loss_fn(output, indices),  # type: ignore[misc]
        )
        losses: list[Tensor] = []
        target = torch.arange(batch_size) if self.holds_last else None
        schedule.step(*(inputs if self.holds_first else ()), target=target, losses=losses)
        if not self.holds_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).sum()

    def forward(self, inputs: tuple[Tensor, ...], batch_size: int) -> Any:
        """Run the batch forward only (GPipe order); the last stage's output on the rank that holds it, else None."""
        microbatches = self.microbatches if batch_size % self.microbatches == 0 else 1
        # One stage per rank: GPipe. A V placement: ZBVZeroBubble, which (unlike DualPipeV) takes any micro-batch count.
        name = self.schedule_name if SCHEDULES[self.schedule_name][1] else "GPipe"
        name = "ZBVZeroBubble" if name in V_SCHEDULES else name
        schedule = self._schedule(("eval", microbatches, *_signature(inputs)), name, microbatches, None)
        return schedule.eval(*(inputs if self.holds_first else ()))
