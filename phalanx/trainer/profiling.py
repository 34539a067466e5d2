"""The Trainer's profiler: ``Trainer(profiler=...)`` resolved, set up per stage, and wrapped around what the loops call.

Without a profiler (``profiler=None``: a :class:`~phalanx.profilers.PassThroughProfiler`) nothing is wrapped and the
loops run exactly as they do unprofiled. With one, each stage's set-up installs wrappers, on the objects the loops
call, that time each call as an action: the module's and callbacks' hooks from the hook table (``[TrainingModule]...``
and ``[Callback]{state_key}...``), the strategy's steps and collectives (``[Strategy]{class}.training_step``,
``.backward``, ``.optimizer_step``, ``.save_checkpoint``...), the fit loop's epochs, batches and batch fetches, and
``trainer.save_checkpoint``. The stage's teardown removes them and writes the report.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Union

from phalanx.profilers import (
    NOT_OFFERED,
    AdvancedProfiler,
    PassThroughProfiler,
    Profiler,
    PyTorchProfiler,
    SimpleProfiler,
)
from phalanx.trainer.state import TrainerFn
from phalanx.utilities.messages import reject_class, shown

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

#: ``Trainer(profiler=NAME)``: the profiler each name makes, with its default arguments (Lightning's names).
PROFILERS: dict[str, type[Profiler]] = {
    "simple": SimpleProfiler,
    "advanced": AdvancedProfiler,
    "pytorch": PyTorchProfiler,
}
#: What ``Trainer(profiler=...)`` accepts.
ProfilerInput = Union[Profiler, str, None]
# The strategy's methods the loops call, each timed as "[Strategy]{class}.{method}": its steps (forward, backward,
# optimizer step, which runs the closure of forward and backward), its checkpoint IO and its collectives.
STRATEGY_ACTIONS = (
    "batch_to_device", "training_step", "validation_step", "test_step", "predict_step", "backward", "optimizer_step",
    "save_checkpoint", "load_checkpoint", "remove_checkpoint", "barrier", "broadcast", "reduce", "all_gather",
)  # fmt: skip


def resolve_profiler(profiler: Any) -> Profiler:
    """``Trainer(profiler=...)`` checked: a Profiler, one of the names of ``PROFILERS``, or None (no profiling)."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        return profiler
    reject_class("profiler", profiler, Profiler, f"one of {sorted(PROFILERS)}")
    if isinstance(profiler, str):
        name = profiler.lower()
        if name in PROFILERS:
            return PROFILERS[name]()
        lightning_name = f"{name.upper()}Profiler"
        if lightning_name in NOT_OFFERED:
            raise ValueError(f"profiler={profiler!r} is not supported: {NOT_OFFERED[lightning_name].instead}.")
        raise ValueError(f"profiler={profiler!r} is not valid; pass one of {sorted(PROFILERS)}, a Profiler or None.")
    raise TypeError(
        f"profiler={shown(profiler)} (of type {type(profiler).__name__}) is not valid; pass one of {sorted(PROFILERS)},"
        " a phalanx.profilers.Profiler or None."
    )


def records(profiler: Profiler) -> bool:
    """Whether ``profiler`` records anything (every profiler but the pass-through one)."""
    return not isinstance(profiler, PassThroughProfiler)


def start_profiling(trainer: Trainer, module: TrainingModule) -> None:
    """At a stage's set-up, once the ranks and the log directory are known: set the profiler up and, when it
    records, install the wrappers (before the hook table is built, which takes the strategy's batch move)."""
    profiler, strategy = trainer.profiler, trainer.strategy
    if not records(profiler):
        return  # not even trainer.log_dir is read: a run without a profiler is the run it was before profilers
    rank = strategy.global_rank if strategy.world_size > 1 else None
    profiler.setup(stage=str(trainer.state.fn), local_rank=rank, log_dir=trainer.log_dir)
    profiler._attach(module, partial(_stage_steps, trainer))
    strategy_name = type(strategy).__name__
    for method in STRATEGY_ACTIONS:
        _install(trainer, strategy, method, f"[Strategy]{strategy_name}.{method}")
    _install(trainer, trainer, "save_checkpoint", "save_checkpoint")
    if trainer.state.fn == TrainerFn.FITTING:
        loop = trainer.fit_loop
        _install(trainer, loop, "_run_epoch", "run_training_epoch")
        _install(trainer, loop, "_automatic_batch", "run_training_batch")
        _install(trainer, loop, "_manual_batch", "run_training_batch")
        epoch_iterator = loop._epoch_iterator

        def profiled_epoch_iterator(*args: Any) -> tuple[Iterator[Any], int]:
            iterator, skip = epoch_iterator(*args)
            return _fetches(iterator, profiler, "[FitLoop].train_dataloader_next"), skip

        _set(trainer, loop, "_epoch_iterator", profiled_epoch_iterator)


def finish_profiling(trainer: Trainer, failed: bool = False) -> None:
    """At a stage's end: remove the wrappers; write the report (``describe``), or after a failure only close it."""
    installed, trainer._run.profiled = trainer._run.profiled, []
    for owner, name, wrapper in reversed(installed):
        if owner.__dict__.get(name) is wrapper:
            del owner.__dict__[name]
    if failed:
        trainer.profiler.teardown(str(trainer.state.fn) if trainer.state.fn is not None else None)
    else:
        trainer.profiler.describe()


def profiled_hooks(
    table: dict[str, tuple[Callable[..., Any], ...]], profiler: Profiler, module: TrainingModule
) -> dict[str, tuple[Callable[..., Any], ...]]:
    """The hook table, each entry timed as ``[Callback]{state_key}.{hook}`` or ``[TrainingModule]{class}.{hook}``."""
    return {
        name: tuple(_timed(entry, profiler, _hook_action(entry, name, module)) for entry in entries)
        for name, entries in table.items()
    }


def _hook_action(entry: Callable[..., Any], hook: str, module: TrainingModule) -> str:
    # Callback entries are partials of the callback's bound method (see HookTable.build); the rest are the module's.
    owner = getattr(getattr(entry, "func", None), "__self__", None)
    if owner is not None and owner is not module:
        return f"[Callback]{getattr(owner, 'state_key', type(owner).__qualname__)}.{hook}"
    return f"[TrainingModule]{type(module).__name__}.{hook}"


def _timed(function: Callable[..., Any], profiler: Profiler, action: str) -> Callable[..., Any]:
    start, stop = profiler.start, profiler.stop

    def timed(*args: Any, **kwargs: Any) -> Any:
        start(action)
        try:
            return function(*args, **kwargs)
        finally:
            stop(action)

    if hasattr(function, "__name__"):
        functools.update_wrapper(timed, function)
    return timed


def _install(trainer: Trainer, owner: Any, name: str, action: str) -> None:
    _set(trainer, owner, name, _timed(getattr(owner, name), trainer.profiler, action))


def _set(trainer: Trainer, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    # An instance attribute shadows the method for this run only; finish_profiling deletes it.
    owner.__dict__[name] = wrapper
    trainer._run.profiled.append((owner, name, wrapper))


def _fetches(iterator: Iterator[Any], profiler: Profiler, action: str) -> Iterator[Any]:
    """``iterator``, each ``next`` timed as ``action``."""
    while True:
        profiler.start(action)
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            profiler.stop(action)
        yield item


def _stage_steps(trainer: Trainer) -> int | float:
    """How many steps of its step function the current stage runs (the PyTorchProfiler records a short stage whole)."""
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        steps = trainer.num_training_batches * max(trainer.max_epochs, 1)
        if trainer.max_steps != -1:
            steps = min(steps, trainer.max_steps * trainer.accumulate_grad_batches)
        return steps
    counts = {
        TrainerFn.VALIDATING: trainer.num_val_batches,
        TrainerFn.TESTING: trainer.num_test_batches,
        TrainerFn.PREDICTING: trainer.num_predict_batches,
    }
    return sum(counts.get(fn) or [])  # type: ignore[arg-type]


__all__ = [
    "PROFILERS",
    "STRATEGY_ACTIONS",
    "ProfilerInput",
    "finish_profiling",
    "profiled_hooks",
    "records",
    "resolve_profiler",
    "start_profiling",
]
