"""The checks that drive a strategy through ``phalanx.Cohort``: a hand-written loop with save, load and resume.

The loop trains the conformance module for the same four batches as the Trainer's fit (Adam, one optimizer step per
batch), saves with ``cohort.save`` after the second and, in a second run on a fresh strategy, loads that checkpoint
with ``cohort.load`` and trains the rest. The judges are the Trainer driver's where the promise is the same.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from phalanx.cohort.cohort import Cohort
from phalanx.strategies.strategy import Strategy
from phalanx.testing.module import ConformanceModule, conformance_data, loss_of
from phalanx.testing.probes import MethodRecorder, observe_no_sync, snapshot
from phalanx.testing.training import (
    SAVE_AT,
    STEPS,
    built_strategy,
    rank_problems,
    refuse_own_launcher,
    sequence_problems,
)

#: The Strategy methods whose order the Cohort lifecycle check records (on return), and the order the Cohort promises.
COHORT_LIFECYCLE_METHODS = ("setup_environment", "connect", "setup", "backward", "optimizer_step")
EXPECTED_COHORT_LIFECYCLE = ("setup_environment", "connect", "setup", *("backward", "optimizer_step") * STEPS)


@dataclass
class LoopRun:
    """One run of the Cohort loop, and what was recorded during it (the judges read it as they read a FitRun)."""

    strategy: Strategy
    label: str
    lifecycle: MethodRecorder | None = None
    ranks: dict[str, Any] | None = None
    saved: dict[str, Any] | None = None
    started: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    no_sync: dict[str, Any] | BaseException | None = None
    error: BaseException | None = None
    error_text: str = ""
    # The loop's Cohort, set-up module and plain module, for the no-sync probe after it.
    cohort: Cohort | None = None
    model: Any = None
    module: ConformanceModule | None = None

    def raise_if_failed(self, what: str | None = None) -> None:
        """Re-raise the loop's error as an AssertionError that says which run failed and how."""
        what = what or self.label
        if isinstance(self.error, SystemExit):
            raise AssertionError(
                f"{what} ended this rank with SystemExit({self.error.code}): the strategy stopped it because another"
                " rank failed (see that rank's error)."
            )
        if self.error is not None:
            raise AssertionError(f"{what} raised {type(self.error).__name__}: {self.error}\n{self.error_text}")


def run_loop(
    make_strategy: Callable[[], Strategy],
    processes: int,
    *,
    seed: int,
    record: bool = False,
    save_at: int | None = None,
    checkpoint: Path | None = None,
    resume_from: Path | None = None,
    no_sync: bool = False,
) -> LoopRun:
    """Run the Cohort loop for four steps on ``make_strategy()``: saving at ``save_at`` to ``checkpoint``, or resuming
    from ``resume_from``; ``no_sync`` probes ``cohort.no_backward_sync`` at the end."""
    strategy = built_strategy(make_strategy)
    label = "the Cohort loop"
    if resume_from is not None:
        label = f"the Cohort loop resumed with cohort.load(<checkpoint saved at step {SAVE_AT}>)"
    run = LoopRun(strategy, label, MethodRecorder(strategy, COHORT_LIFECYCLE_METHODS) if record else None)
    try:
        _loop(run, processes, seed=seed, save_at=save_at, checkpoint=checkpoint, resume_from=resume_from)
        if no_sync:
            _probe_no_sync(run)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - SystemExit too: a strategy may end a rank whose peer failed
        run.error, run.error_text = error, "".join(traceback.format_exception(error)[-6:])
    return run


def _loop(
    run: LoopRun,
    processes: int,
    *,
    seed: int,
    save_at: int | None,
    checkpoint: Path | None,
    resume_from: Path | None,
) -> None:
    strategy = run.strategy
    options: dict[str, Any] = {"accelerator": "cpu"} if strategy.accelerator is None else {}
    cohort = Cohort(strategy=strategy, devices=processes, **options)
    refuse_own_launcher(strategy)
    cohort.launch()
    torch.manual_seed(seed)
    module = ConformanceModule()
    model, optimizer = cohort.setup(module, torch.optim.Adam(module.parameters(), lr=0.01))
    run.ranks = {
        "world_size": strategy.world_size,
        "global_rank": strategy.global_rank,
        "is_global_zero": strategy.is_global_zero,
        "optimizers": len(strategy.optimizers),
    }
    replicas = int((strategy.distributed_sampler_kwargs or {}).get("num_replicas", 1))
    loader = cohort.setup_dataloaders(conformance_data(replicas))
    state = {"model": model, "optimizer": optimizer}
    done = 0
    if resume_from is not None:
        cohort.load(resume_from, state)
        run.started = snapshot(strategy, optimizers=True)
        done = cohort.global_step  # the loader starts the saved epoch again: skip what was trained
    for index, batch in enumerate(loader):
        if index < done:
            continue
        optimizer.zero_grad()
        cohort.backward(loss_of(model, batch))
        optimizer.step()
        if save_at is not None and cohort.global_step == save_at:
            run.saved = snapshot(strategy, optimizers=True)
            cohort.save(checkpoint, state)  # type: ignore[arg-type]  # save_at comes with a checkpoint path
        if cohort.global_step == STEPS:
            break
    run.final = snapshot(strategy, optimizers=False)
    run.cohort, run.model, run.module = cohort, model, module


def _probe_no_sync(run: LoopRun) -> None:
    cohort, model, module = run.cohort, run.model, run.module
    assert cohort is not None and module is not None
    module.recording = False
    if run.lifecycle is not None:
        run.lifecycle.active = False  # the probe's backward passes are not the loop's

    def backward(batch: Any, index: int) -> None:
        cohort.backward(loss_of(model, cohort.to_device(batch)))

    try:
        run.no_sync = observe_no_sync(run.strategy, module, backward, lambda: cohort.no_backward_sync(model))
    except Exception as error:  # noqa: BLE001 - judged (and reported) by the no_sync check
        run.no_sync = error


def judge_cohort_lifecycle(run: LoopRun, *, rank: int, processes: int) -> None:
    """The Cohort called the strategy's methods in the documented order, and the strategy reports this rank's place."""
    run.raise_if_failed()
    assert run.lifecycle is not None
    problems = sequence_problems(
        "Strategy methods called by the Cohort loop", EXPECTED_COHORT_LIFECYCLE, run.lifecycle.events
    )
    problems += rank_problems(run.ranks or {}, rank=rank, processes=processes)
    if problems:
        raise AssertionError("\n".join(problems))
