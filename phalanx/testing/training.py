"""The checks that drive a strategy through ``Trainer.fit`` (its defaults on): lifecycle order, hooks, no-sync,
teardown, resume; the no-sync and resume judges serve the Cohort driver (``cohort_driver.py``) too."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from phalanx.strategies.strategy import Strategy
from phalanx.testing.module import BATCH_HOOKS, RUN_HOOKS, ConformanceModule
from phalanx.testing.probes import MethodRecorder, ProbeCallback, differences, record_plugin_teardowns
from phalanx.testing.report import NotApplicable
from phalanx.trainer.trainer import Trainer

STEPS, SAVE_AT = 4, 2  # every fit trains four batches; the first saves a checkpoint after the second

#: The Strategy methods whose order the lifecycle check records (on return), and the order the Trainer promises.
LIFECYCLE_METHODS = (
    "connect",
    "setup_environment",
    "setup",
    "on_train_start",
    "on_train_batch_start",
    "training_step",
    "backward",
    "optimizer_step",
    "on_train_end",
    "teardown",
)
BATCH_CYCLE = ("on_train_batch_start", "training_step", "backward", "optimizer_step")
EXPECTED_LIFECYCLE = (
    "connect",
    "setup_environment",
    "setup",
    "on_train_start",
    *BATCH_CYCLE * STEPS,
    "on_train_end",
    "teardown",
)
_RUN_START, _RUN_END = RUN_HOOKS[:6], RUN_HOOKS[6:]
EXPECTED_HOOKS = (*_RUN_START, *(BATCH_HOOKS[0], "training_step", *BATCH_HOOKS[1:]) * STEPS, *_RUN_END)
PLUGIN_TEARDOWNS = ("accelerator.teardown", "precision_plugin.teardown", "checkpoint_io.teardown")


@dataclass
class FitRun:
    """One ``Trainer.fit`` of the conformance module, and what was recorded during it."""

    strategy: Strategy
    trainer: Any
    module: ConformanceModule
    callback: ProbeCallback
    lifecycle: MethodRecorder | None = None
    teardowns: list[str] = field(default_factory=list)
    error: BaseException | None = None
    error_text: str = ""
    label: str = "Trainer.fit"

    # What the judges read of any driver's run (the Cohort loop's run has the same names).
    @property
    def saved(self) -> dict[str, Any] | None:
        """The state snapshot taken where the checkpoint was saved."""
        return self.callback.saved

    @property
    def started(self) -> dict[str, Any] | None:
        """The state a resumed run started from, right after loading."""
        return self.callback.started

    @property
    def final(self) -> dict[str, Any] | None:
        """The state at the end."""
        return self.callback.final

    @property
    def no_sync(self) -> dict[str, Any] | BaseException | None:
        """What the no-sync probe saw (None: it did not run)."""
        return self.callback.no_sync

    def raise_if_failed(self, what: str | None = None) -> None:
        """Re-raise the run's error as an AssertionError that says which run failed and how."""
        what = what or self.label
        if isinstance(self.error, SystemExit):
            raise AssertionError(
                f"{what} ended this rank with SystemExit({self.error.code}): the strategy stopped it because another"
                " rank failed (see that rank's error)."
            )
        if self.error is not None:
            raise AssertionError(f"{what} raised {type(self.error).__name__}: {self.error}\n{self.error_text}")


def built_strategy(make_strategy: Callable[[], Strategy]) -> Strategy:
    """``make_strategy()``, checked to be a Strategy instance."""
    strategy = make_strategy()
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"make_strategy returned {type(strategy).__name__}; it must return a phalanx.strategies.Strategy instance."
        )
    return strategy


def refuse_own_launcher(strategy: Strategy) -> None:
    """The kit starts the ranks itself: a strategy that would start processes cannot run in them."""
    if strategy.launcher is not None:
        raise ValueError(
            f"{type(strategy).__name__} would start processes itself ({type(strategy.launcher).__name__}); the"
            " conformance kit starts them and runs each rank as a launched process. Build the strategy as a"
            " script launch would (start_method='popen')."
        )


def run_fit(
    make_strategy: Callable[[], Strategy],
    processes: int,
    *,
    seed: int,
    root: Path,
    record: bool = False,
    ckpt_path: Path | None = None,
    label: str = "Trainer.fit",
    **probes: Any,
) -> FitRun:
    """Fit the conformance module for four steps on ``make_strategy()`` with the Trainer's defaults on (its logger
    and checkpoint folder under ``root``, progress bar, model summary); ``probes`` configure the ProbeCallback."""
    strategy = built_strategy(make_strategy)
    lifecycle = MethodRecorder(strategy, LIFECYCLE_METHODS) if record else None
    callback = ProbeCallback(recorder=lifecycle, **probes)
    options: dict[str, Any] = {"accelerator": "cpu"} if strategy.accelerator is None else {}
    trainer = Trainer(
        strategy=strategy, devices=processes, max_steps=STEPS, callbacks=[callback], default_root_dir=root, **options
    )
    refuse_own_launcher(strategy)
    teardowns = record_plugin_teardowns(strategy) if record else []
    torch.manual_seed(seed)
    module = ConformanceModule()
    run = FitRun(strategy, trainer, module, callback, lifecycle, teardowns, label=label)
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - SystemExit too: a strategy may end a rank whose peer failed
        run.error, run.error_text = error, "".join(traceback.format_exception(error)[-6:])
    return run


# ---------------------------------------------------------------------------- judging the first fit
def judge_lifecycle(run: FitRun, *, rank: int, processes: int) -> None:
    """The Trainer called the strategy's methods in the documented order, and the strategy reports this rank's place."""
    run.raise_if_failed("Trainer.fit")
    assert run.lifecycle is not None
    problems = sequence_problems("Strategy methods called by Trainer.fit", EXPECTED_LIFECYCLE, run.lifecycle.events)
    problems += rank_problems(run.callback.ranks or {}, rank=rank, processes=processes)
    if problems:
        raise AssertionError("\n".join(problems))


def rank_problems(seen: dict[str, Any], *, rank: int, processes: int) -> list[str]:
    """What the strategy reported wrongly after setup: this rank's place, and its one optimizer."""
    problems = []
    expected = {"world_size": processes, "global_rank": rank, "is_global_zero": rank == 0}
    for name, value in expected.items():
        if seen.get(name) != value:
            problems.append(
                f"strategy.{name} was {seen.get(name)!r} on rank {rank} after setup; expected {value!r}"
                f" ({processes} processes)."
            )
    if seen.get("optimizers") != 1:
        problems.append(f"strategy.optimizers held {seen.get('optimizers')} optimizer(s) after setup; expected one.")
    return problems


def judge_hooks(run: FitRun) -> None:
    """Every module hook of a fit was called, in order, once per run or once per batch."""
    run.raise_if_failed("Trainer.fit")
    problems = sequence_problems("TrainingModule hooks called during Trainer.fit", EXPECTED_HOOKS, run.module.events)
    if problems:
        raise AssertionError("\n".join(problems))


def sequence_problems(what: str, expected: tuple[str, ...], seen: list[str]) -> list[str]:
    """Where ``seen`` first departs from ``expected`` (nothing when they are equal), both shown folded."""
    if tuple(seen) == expected:
        return []
    index = next(
        (i for i, (want, got) in enumerate(zip(expected, seen, strict=False)) if want != got),
        min(len(expected), len(seen)),
    )
    want = expected[index] if index < len(expected) else "nothing more"
    got = seen[index] if index < len(seen) else "nothing more"
    return [
        f"{what}: call #{index} was {got!r}, expected {want!r}.\n"
        f"  expected: {_compact(expected)}\n"
        f"  seen:     {_compact(seen)}"
    ]


def _compact(names: Any) -> str:
    """Names with the repeated per-batch cycles folded: 'a, b, [c, d] x 4, e'."""
    names = list(names)
    parts: list[str] = []
    index = 0
    while index < len(names):
        for size in (7, 4):
            cycle = names[index : index + size]
            repeats = 1
            while len(cycle) == size and names[index + repeats * size : index + (repeats + 1) * size] == cycle:
                repeats += 1
            if repeats > 1:
                parts.append(f"[{', '.join(cycle)}] x {repeats}")
                index += repeats * size
                break
        else:
            parts.append(names[index])
            index += 1
    return ", ".join(parts)


def judge_no_sync(run: Any, *, rank: int) -> None:
    """Inside ``block_backward_sync()`` each rank keeps its own gradients; the next synced backward averages the sum."""
    run.raise_if_failed()
    observed = run.no_sync
    if isinstance(observed, NotApplicable):
        raise observed
    if isinstance(observed, BaseException):
        raise AssertionError(
            "the no-sync probe (backward inside and after block_backward_sync()) raised"
            f" {type(observed).__name__}: {observed}"
        )
    if observed is None:
        raise AssertionError(f"the no-sync probe did not run ({run.label} did not reach its end).")
    ranks = observed["ranks"]
    replicas = {seen["replica"]: seen for seen in ranks}
    mean_first = _mean([seen["local_first"] for seen in replicas.values()])
    mean_total = _mean([_sum(seen["local_first"], seen["local_second"]) for seen in replicas.values()])
    mine = ranks[rank]
    synchronised: list[str] = []
    wrong_inside: list[str] = []
    missing: list[str] = []
    wrong_outside: list[str] = []
    for name, inside in mine["inside"].items():
        # None: deferred until the synchronised backward (FSDP keeps unsharded gradients aside meanwhile).
        if inside is not None and not _close(inside, mine["local_first"][name]):
            (synchronised if _close(inside, mean_first[name]) else wrong_inside).append(name)
    for name, outside in mine["outside"].items():
        if outside is None:
            missing.append(name)
        elif not _close(outside, mean_total[name]):
            wrong_outside.append(name)
    problems = []
    if synchronised:
        problems.append(
            f"inside block_backward_sync() the gradients of {synchronised} on rank {rank} were the mean over the"
            " data-parallel ranks: the gradient synchronisation was not skipped."
        )
    if wrong_inside:
        problems.append(
            f"inside block_backward_sync() the gradients of {wrong_inside} on rank {rank} are neither this rank's own"
            " gradients nor deferred (None)."
        )
    if missing:
        problems.append(
            f"after a backward outside block_backward_sync() the gradients of {missing} on rank {rank} are None."
        )
    if wrong_outside:
        problems.append(
            f"after a backward outside block_backward_sync() the gradients of {wrong_outside} on rank {rank} are"
            " not the mean over the data-parallel ranks of both backward passes (the one inside the context was"
            " lost or synchronised twice)."
        )
    if problems:
        raise AssertionError("\n".join(problems))


def _mean(gradients: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([g[name] for g in gradients]).mean(0) for name in gradients[0]}


def _sum(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: first[name] + second[name] for name in first}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.allclose(actual.float(), expected.float(), rtol=1e-4, atol=1e-6)


def judge_teardown(run: FitRun, *, rank: int, processes: int, after_fit_checkpoint: Path) -> None:
    """After fit, the strategy released its wrapper and plugins, kept the process group, and can still save."""
    run.raise_if_failed("Trainer.fit")
    strategy = run.strategy
    problems = [
        f"Strategy.teardown() did not call {name}() (teardown must release the parts setup prepared)."
        for name in PLUGIN_TEARDOWNS
        if name not in run.teardowns
    ]
    if (
        getattr(strategy, "cluster_environment", None) is not None
        and "cluster_environment.teardown" not in run.teardowns
    ):
        problems.append("Strategy.teardown() did not call cluster_environment.teardown().")
    if strategy.model is not strategy.module:
        problems.append(
            f"after teardown strategy.model is still a {type(strategy.model).__name__}: teardown must release the"
            " wrapper (strategy.model is strategy.module)."
        )
    if processes > 1 and not torch.distributed.is_initialized():
        problems.append(
            "teardown destroyed the process group; it must stay for later calls (validate, save_checkpoint,"
            " collectives) until the process exits."
        )
    try:
        run.trainer.save_checkpoint(after_fit_checkpoint)
    except Exception as error:  # noqa: BLE001 - the finding
        problems.append(
            f"trainer.save_checkpoint() after fit raised {type(error).__name__}: {error} (the module and optimizers"
            " must stay usable after teardown)."
        )
    else:
        if rank == 0 and not after_fit_checkpoint.exists():
            problems.append(f"trainer.save_checkpoint({str(after_fit_checkpoint)!r}) after fit wrote nothing there.")
    if problems:
        raise AssertionError("\n".join(problems))


# ---------------------------------------------------------------------------- the resumed fit
def judge_checkpoint(first: Any, resumed: Any, *, atol: float) -> None:
    """The resumed run starts from exactly the saved weights and optimizer state, and ends where the first run ended
    (``first`` and ``resumed``: a FitRun or a Cohort LoopRun)."""
    first.raise_if_failed()
    resumed.raise_if_failed()
    saved, started = first.saved, resumed.started
    if saved is None:
        raise AssertionError(f"{first.label} never reached global_step {SAVE_AT}, where the checkpoint is saved.")
    assert started is not None and first.final is not None and resumed.final is not None
    problems = []
    for part, label in (("weights", "module_state_dict()"), ("optimizers", "optimizer_state()")):
        found = differences(saved[part], started[part], path=label)
        if found:
            problems.append(
                f"after loading the checkpoint, {label} differs from the state saved at step {SAVE_AT}:\n    "
                + "\n    ".join(found)
            )
    found = differences(first.final["weights"], resumed.final["weights"], atol=atol, path="module_state_dict()")
    if found:
        problems.append(
            f"the resumed run ended at step {STEPS} with other weights than the uninterrupted run:\n    "
            + "\n    ".join(found)
        )
    if problems:
        raise AssertionError("\n".join(problems))
