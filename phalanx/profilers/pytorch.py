"""PyTorchProfiler: torch.profiler around a stage, with the Trainer's actions as labelled ranges, a schedule over the
stage's steps, an operator table as the report and a Chrome/TensorBoard trace."""

from __future__ import annotations

import inspect
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.profiler import EventList, record_function
from torch.profiler import ProfilerAction, ProfilerActivity, tensorboard_trace_handler

from phalanx.profilers.profiler import Profiler
from phalanx.utilities.messages import shown
from phalanx.utilities.rank_zero import rank_zero_warn

# The action whose end is a step of the schedule, per stage: a training batch (its forward runs inside the optimizer
# step's closure, so the batch, not training_step, is what ends at a step boundary), or an evaluation step.
_STEP_OF_STAGE = {
    "fit": "run_training_batch", "validate": "validation_step", "test": "test_step", "predict": "predict_step"
}  # fmt: skip
# The keyword arguments of torch.profiler.profile, and the two this profiler reads itself (Lightning's names).
_TORCH_ARGUMENTS = frozenset(inspect.signature(torch.profiler.profile.__init__).parameters) - {"self"}
_OWN_ARGUMENTS = frozenset({"export_to_flame_graph", "metric"})
_TABLE_ARGUMENTS = frozenset(inspect.signature(EventList.table).parameters) - {"self", "sort_by", "row_limit"}
# Lightning's default: skip the first step, warm up on the second, record the next three; once per stage.
_DEFAULT_WAIT, _DEFAULT_WARMUP, _DEFAULT_ACTIVE = 1, 1, 3
_SCHEDULED = _DEFAULT_WAIT + _DEFAULT_WARMUP + _DEFAULT_ACTIVE


def _record_every_step(step: int) -> ProfilerAction:
    return ProfilerAction.RECORD


def _unknown_steps() -> float:
    return float("inf")


class PyTorchProfiler(Profiler):
    """Runs :class:`torch.profiler.profile` through a stage: operators on the CPU (and CUDA when available), with
    each Trainer action (hook, strategy step, ...) as a labelled range ``[pl][profile]{action}`` and each submodule's
    forward as ``[pl][module]{type}: {name}`` (the labels Lightning writes, which trace viewers group by).

    The schedule counts the stage's steps (training batches during fit, ``validation_step`` calls during validate,
    ...). By default it waits one step, warms up one and records three, once per stage; a stage of fewer than five
    steps is recorded whole. Each recorded window is written as a Chrome trace (``{dirpath}/{stage}-{filename}-{rank}
    .{timestamp}.pt.trace.json``, readable by ``chrome://tracing``, Perfetto and TensorBoard's profiler plugin) and
    the report is a table of the operators of the last window.

    Args:
        dirpath: See :class:`~phalanx.profilers.Profiler`.
        filename: See :class:`~phalanx.profilers.Profiler`.
        group_by_input_shapes: Group the report's operators by input shape too (needs ``record_shapes=True``).
        emit_nvtx: Emit NVTX ranges for ``nsys``/``nvprof`` instead (CUDA only; no report, no trace).
        export_to_chrome: Write the Chrome trace of each recorded window (needs a ``dirpath``, given or the Trainer's).
        row_limit: Rows of the report's table (-1: all).
        sort_by_key: The column the table is sorted by, one of ``AVAILABLE_SORT_KEYS``; by default the total
            CUDA time when CUDA is recorded, else the total CPU time.
        record_module_names: Label each submodule's forward with its name.
        table_kwargs: More keyword arguments of the table (``torch.autograd.profiler_util.EventList.table``).
        **profiler_kwargs: Keyword arguments of :class:`torch.profiler.profile` (``schedule``, ``activities``,
            ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops``, ``on_trace_ready``...), and
            ``export_to_flame_graph`` / ``metric`` to write the stacks for a flame graph (``.stack``).
    """

    AVAILABLE_SORT_KEYS = frozenset(
        {
            "cpu_time", "cuda_time", "cpu_time_total", "cuda_time_total", "cpu_memory_usage", "cuda_memory_usage",
            "self_cpu_memory_usage", "self_cuda_memory_usage", "count",
        }
    )  # fmt: skip

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        group_by_input_shapes: bool = False,
        emit_nvtx: bool = False,
        export_to_chrome: bool = True,
        row_limit: int = 20,
        sort_by_key: str | None = None,
        record_module_names: bool = True,
        table_kwargs: dict[str, Any] | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        _check_arguments(profiler_kwargs, table_kwargs or {}, emit_nvtx)
        activities = profiler_kwargs.get("activities")
        if activities is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._activities = list(activities)
        self._sort_by_key = sort_by_key or _default_sort_key(self._activities)
        if self._sort_by_key not in self.AVAILABLE_SORT_KEYS:
            raise ValueError(
                f"sort_by_key={shown(sort_by_key)} is not valid; pass one of {sorted(self.AVAILABLE_SORT_KEYS)}."
            )
        self._group_by_input_shapes = group_by_input_shapes and bool(profiler_kwargs.get("record_shapes", False))
        self._emit_nvtx = emit_nvtx
        self._export_to_chrome = export_to_chrome
        self._row_limit = row_limit
        self._record_module_names = record_module_names
        self._table_kwargs = dict(table_kwargs or {})
        self._profiler_kwargs = dict(profiler_kwargs)
        self._flame_graph = bool(self._profiler_kwargs.pop("export_to_flame_graph", False))
        self._metric = self._profiler_kwargs.pop("metric", "self_cpu_time_total")
        self.profiler: Any = None  # the running torch profiler (or NVTX emitter), between the first action and describe
        self.function_events: EventList | None = None
        self._ranges: dict[str, record_function] = {}
        self._module: nn.Module | None = None
        self._stage_steps: Callable[[], int | float] = _unknown_steps
        self._steps_taken = 0
        self._step_function = "run_training_batch"
        self._module_labels: list[Any] = []
        self._nvtx_parent: AbstractContextManager | None = None

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Follow ``stage``'s step function (see :meth:`Profiler.setup`)."""
        super().setup(stage, local_rank=local_rank, log_dir=log_dir)
        self._step_function = _STEP_OF_STAGE.get(stage, "run_training_batch")
        self._steps_taken = 0
        self.function_events = None

    def _attach(self, module: Any, stage_steps: Callable[[], int | float]) -> None:
        self._module = module if isinstance(module, nn.Module) else None
        self._stage_steps = stage_steps

    # ------------------------------------------------------------------ recording
    def start(self, action_name: str) -> None:
        """Start torch's profiler at the stage's first action; open the range labelled ``action_name``."""
        if self.profiler is None:
            self._start_profiler()
        if action_name not in self._ranges:
            labelled = record_function("[pl][profile]" + action_name)
            labelled.__enter__()
            self._ranges[action_name] = labelled

    def stop(self, action_name: str) -> None:
        """Close the range labelled ``action_name``; after a step of the stage, advance the schedule."""
        labelled = self._ranges.pop(action_name, None)
        if labelled is not None:
            labelled.__exit__(None, None, None)
        if self._emit_nvtx or not isinstance(self.profiler, torch.profiler.profile):
            return
        if action_name.endswith(self._step_function):
            if self._steps_taken == 0 and "schedule" not in self._profiler_kwargs and self._stage_steps() < _SCHEDULED:
                # Too short a stage for the default schedule to reach its recording steps: record all of it.
                self.profiler.schedule = _record_every_step
            self._steps_taken += 1
            self.profiler.step()

    def _start_profiler(self) -> None:
        if self._emit_nvtx:
            self._nvtx_parent = torch.cuda.profiler.profile()
            self._nvtx_parent.__enter__()
            nvtx_arguments = {"record_shapes": bool(self._profiler_kwargs.get("record_shapes", False))}
            self.profiler = torch.autograd.profiler.emit_nvtx(**nvtx_arguments)
        else:
            self.profiler = torch.profiler.profile(**self._torch_arguments())
        self.profiler.__enter__()
        if self._record_module_names and self._module is not None:
            self._module_labels = _label_submodules(self._module)

    def _torch_arguments(self) -> dict[str, Any]:
        arguments = {key: value for key, value in self._profiler_kwargs.items() if key in _TORCH_ARGUMENTS}
        arguments["activities"] = self._activities
        if "schedule" not in arguments:
            arguments["schedule"] = torch.profiler.schedule(
                wait=_DEFAULT_WAIT, warmup=_DEFAULT_WARMUP, active=_DEFAULT_ACTIVE, repeat=1
            )
        if "on_trace_ready" not in arguments:
            arguments["on_trace_ready"] = self._trace_ready
        if self._flame_graph:
            arguments["with_stack"] = True
        return arguments

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        if self.dirpath is None:
            rank_zero_warn("PyTorchProfiler: no trace is written, as it has no directory; pass dirpath=.")
            return
        name = self._prepare_filename(extension="")
        if self._export_to_chrome:
            tensorboard_trace_handler(str(self.dirpath), name)(profiler)
        if self._flame_graph:
            profiler.export_stacks(os.path.join(self.dirpath, name + ".stack"), metric=self._metric)

    def _stop_profiler(self) -> None:
        profiler, self.profiler = self.profiler, None
        for labelled in self._module_labels:
            labelled.remove()
        self._module_labels = []
        if profiler is not None:
            profiler.__exit__(None, None, None)
            if isinstance(profiler, torch.profiler.profile) and profiler.profiler is not None:
                self.function_events = profiler.events()  # None before any step was recorded (nothing to report)
        parent, self._nvtx_parent = self._nvtx_parent, None
        if parent is not None:
            parent.__exit__(None, None, None)

    # ------------------------------------------------------------------ report
    def summary(self) -> str:
        """The operators of the last recorded window, as torch's table."""
        self._stop_profiler()
        if self._emit_nvtx or not self.function_events:
            return ""
        averages = self.function_events.key_averages(group_by_input_shapes=self._group_by_input_shapes)
        table = averages.table(sort_by=self._sort_by_key, row_limit=self._row_limit, **self._table_kwargs)
        rank = f" rank: {self._rank}" if self._rank is not None else ""
        title = f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"
        return f"{title}\nProfile stats for: records{rank}\n{table}"

    def teardown(self, stage: str | None) -> None:
        """Stop torch's profiler (a failed stage never reached :meth:`describe`) and close the open ranges."""
        for labelled in self._ranges.values():
            labelled.__exit__(None, None, None)
        self._ranges = {}
        self._stop_profiler()
        super().teardown(stage)

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker starts with no running profiler, ranges or module labels (none can be pickled).
        state = super().__getstate__()
        state.update(
            profiler=None,
            function_events=None,
            _ranges={},
            _module=None,
            _module_labels=[],
            _stage_steps=_unknown_steps,
        )
        return state


def _check_arguments(profiler_kwargs: dict[str, Any], table_kwargs: dict[str, Any], emit_nvtx: bool) -> None:
    unknown = sorted(set(profiler_kwargs) - _TORCH_ARGUMENTS - _OWN_ARGUMENTS)
    if unknown:
        raise TypeError(
            f"PyTorchProfiler got unknown keyword arguments {unknown}; torch.profiler.profile takes"
            f" {sorted(_TORCH_ARGUMENTS)}, and PyTorchProfiler also takes {sorted(_OWN_ARGUMENTS)}."
        )
    unknown = sorted(set(table_kwargs) - _TABLE_ARGUMENTS)
    if unknown:
        raise TypeError(
            f"table_kwargs holds unknown keys {unknown}; EventList.table takes {sorted(_TABLE_ARGUMENTS)}"
            " (sort_by and row_limit are PyTorchProfiler's sort_by_key and row_limit)."
        )
    schedule = profiler_kwargs.get("schedule")
    if schedule is not None:
        if not callable(schedule):
            raise TypeError(
                f"schedule={shown(schedule)} is not callable; pass torch.profiler.schedule(...) or a function of the"
                " step returning a torch.profiler.ProfilerAction."
            )
        first = schedule(0)
        if not isinstance(first, ProfilerAction):
            raise TypeError(
                f"schedule(0) returned {shown(first)}, not a torch.profiler.ProfilerAction; pass"
                " torch.profiler.schedule(...) or a function of the step that returns one."
            )
    if emit_nvtx and not torch.cuda.is_available():
        raise ValueError("PyTorchProfiler(emit_nvtx=True) needs CUDA, which is not available here; leave it False.")


def _default_sort_key(activities: list[Any]) -> str:
    return "cuda_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total"


def _label_submodules(module: nn.Module) -> list[Any]:
    """Hooks that open a ``[pl][module]{type}: {name}`` range around each submodule's forward; returns their handles."""
    handles = []
    for name, submodule in module.named_modules():
        if not name:
            continue
        label = f"[pl][module]{type(submodule).__module__}.{type(submodule).__name__}: {name}"
        handles.extend(_label_forward(submodule, label))
    return handles


def _label_forward(module: nn.Module, label: str) -> list[Any]:
    open_ranges: list[record_function] = []

    def before(*_: Any) -> None:
        labelled = record_function(label)
        labelled.__enter__()
        open_ranges.append(labelled)

    def after(*_: Any) -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after, always_call=True)]


__all__ = ["PyTorchProfiler"]
