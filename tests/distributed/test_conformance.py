"""The conformance kit (phalanx.testing) on every built-in strategy, through both drivers (the Trainer with its defaults
on and the Cohort), and on broken strategies it must fail through both.

One launch per run (tests/strategy_cases.py: each row's ``kit``) runs every check of both drivers. Launches fork from
this process, which has already imported torch and torch._dynamo (DistributedDataParallel imports it, about 5 s a
process here); one launch uses the default spawn. The Cohort driver (4 batches, a save, one resume) and the Trainer's
defaults add a few seconds per launch: on a shared 2-core machine the six launches without DeepSpeed took 41.6 s
against 34.9 s before, and the nine built-in launches about 3 minutes either way (DeepSpeed's start-up dominates).
"""

from __future__ import annotations

import multiprocessing
import time
from contextlib import nullcontext
from functools import partial
from typing import Any

import pytest
import torch
from strategy_cases import CASES

from phalanx.strategies import DDPStrategy, SingleDeviceStrategy
from phalanx.testing import CHECKS_BY_DRIVER, DRIVERS, StrategyConformanceError, check_strategy, run_conformance

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

FORK = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
ALL = [(driver, check) for driver in DRIVERS for check in CHECKS_BY_DRIVER[driver]]


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    import torch._dynamo  # noqa: F401 - imported once here, inherited by every forked rank


# ---------------------------------------------------------------------------- every built-in strategy passes
# The runs come from tests/strategy_cases.py, whose test (tests/unit/test_strategy_cases.py) fails for a registered
# built-in without a row, and for a class that no row runs through the kit.
BUILT_IN = [pytest.param(row, run, id=run.id) for row in CASES for run in row.kit]


@pytest.mark.parametrize(("row", "run"), BUILT_IN)
def test_built_in_strategy_passes_every_check_through_both_drivers(row, run, monkeypatch):
    if row.needs is not None:
        pytest.importorskip(row.needs)
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    report = run_conformance(run.make, processes=run.processes, start_method=FORK, timeout=400)
    assert [result.label for result in report.failures] == [], report.describe_failures()
    skipped = {key for key, result in report.results.items() if result.status == "skipped"}
    assert skipped == {(driver, check) for driver, check in ALL if {check, driver} & run.skipped}, report.summary()
    assert list(report.results) == ALL and report.drivers == list(DRIVERS)


class SpawnedStrategy(SingleDeviceStrategy):
    """Defined in this test module: a spawned process must import it by name, as a user's strategy is."""


def test_check_strategy_runs_with_spawned_processes_and_returns_the_report():
    # The default start method: make_strategy travels pickled; a Strategy class is its own factory.
    report = check_strategy(SpawnedStrategy, checks=["lifecycle", "reduce", "checkpoint"])
    assert report.strategy == "SpawnedStrategy" and report.processes == 1
    assert list(report.results) == [
        ("trainer", "lifecycle"), ("trainer", "reduce"), ("trainer", "checkpoint"),
        ("cohort", "lifecycle"), ("cohort", "checkpoint"),
    ]  # fmt: skip
    assert [result.status for result in report.results.values()] == ["passed"] * 5


# ---------------------------------------------------------------------------- broken strategies fail, naming the check
class BrokenCollectives(DDPStrategy):
    """Collectives that run but give wrong answers (nothing here may make a rank wait forever)."""

    def reduce(self, tensor: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        return super().reduce(
            tensor, group, "sum" if reduce_op in (None, "mean") else reduce_op
        )  # sums instead of averaging

    def barrier(self, name: str | None = None) -> None:
        """Does nothing."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj  # the local object

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return (
            super().all_gather(tensor, group, sync_grads).flatten(0, 1)
            if tensor.dim()
            else super().all_gather(tensor, group, sync_grads)
        )

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        return decision  # never asks the other ranks


class BrokenTraining(DDPStrategy):
    """Mistakes in the training contract that leave Trainer.fit running."""

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.setup_environment()  # set-up again: the lifecycle order breaks
        super().setup(*args, **kwargs)

    def block_backward_sync(self) -> Any:
        return nullcontext()  # still synchronises gradients

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure)  # bypasses the precision plugin: on_before_optimizer_step never runs

    def teardown(self) -> None:
        """Releases nothing."""

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Ignores the saved optimizer state."""


SYNC_SKIPPED = "were the mean over the data-parallel ranks: the gradient synchronisation was not skipped."
OPTIMIZER_IGNORED = "after loading the checkpoint, optimizer_state() differs from the state saved at step 2"
BROKEN = [
    pytest.param(BrokenCollectives, {
        "trainer/reduce": "reduce(tensor) on rank 0 with [1.0, -2.0] returned [3.0, -6.0]; expected the mean over 2",
        "trainer/all_gather": "all_gather(tensor of shape (1, 3)) on rank 0 returned shape (2, 3); expected (2, 1, 3)",
        "trainer/broadcast": "broadcast(obj, src=1) on rank 0 returned {'from': 0,",
        "trainer/barrier": "barrier() on rank 0 returned after",
        "trainer/reduce_boolean_decision": "all=True) when only rank 0 decides True returned True on rank 0",
    }, id="collectives"),
    pytest.param(BrokenTraining, {
        "trainer/lifecycle": "by Trainer.fit: call #2 was 'setup_environment', expected 'setup'.",
        "trainer/hooks": "during Trainer.fit: call #10 was 'on_before_zero_grad', expected 'on_before_optimizer_step'.",
        "trainer/no_sync": SYNC_SKIPPED,
        "trainer/teardown": "Strategy.teardown() did not call accelerator.teardown()",
        "trainer/checkpoint": OPTIMIZER_IGNORED,
        "cohort/lifecycle": "by the Cohort loop: call #2 was 'setup_environment', expected 'setup'.",
        "cohort/no_sync": SYNC_SKIPPED,
        "cohort/checkpoint": OPTIMIZER_IGNORED,
    }, id="training"),
]  # fmt: skip


@pytest.mark.parametrize(("make_strategy", "expected"), BROKEN)
def test_broken_strategy_fails_exactly_the_checks_it_breaks(make_strategy, expected):
    with pytest.raises(StrategyConformanceError) as raised:
        check_strategy(make_strategy, processes=2, start_method=FORK, timeout=300)
    message = str(raised.value)
    assert message.startswith(
        f"{make_strategy.__qualname__} failed {len(expected)} of {len(ALL)} conformance checks on 2 processes:"
    ), message
    failed = [line.strip()[2:-1] for line in message.splitlines() if line.startswith("  - ")]
    assert failed == [f"{driver}/{check}" for driver, check in ALL if f"{driver}/{check}" in expected], message
    sections = dict(section.split(":\n", 1) for section in message.split("\n  - ")[1:])
    for label, text in expected.items():
        assert text in sections[label], f"{label}: {text!r} not in\n{message}"


class HangingBarrier(DDPStrategy):
    """Rank 1 never reaches the barrier: rank 0 would wait in it forever."""

    def barrier(self, name: str | None = None) -> None:
        if name == "conformance" and self.global_rank == 1:
            time.sleep(3600)
        super().barrier(name)


def test_a_rank_stuck_in_a_collective_is_stopped_at_the_timeout_and_reported(tmp_path):
    start = time.monotonic()
    report = run_conformance(
        HangingBarrier, processes=2, start_method=FORK, checks=["barrier", "broadcast"], timeout=15, workdir=tmp_path,
        drivers=["trainer"],
    )  # fmt: skip
    # A hang bound, not a speed claim: the stuck rank sleeps an hour; the run ends at its 15 s timeout plus start-up.
    assert time.monotonic() - start < 120
    assert report["broadcast"].passed  # ran before the barrier: its result was kept
    assert [result.name for result in report.failures] == ["barrier"]
    assert (
        "did not finish: stopped while running 'trainer/barrier': the run reached its 15 s timeout"
        in report["barrier"].message
    )
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("phalanx-conformance")]
    assert sorted(path.name for path in next(tmp_path.iterdir()).iterdir() if path.suffix == ".json") == [
        "rank0.json",
        "rank1.json",
    ]


class RaisesOnRankOne(DDPStrategy):
    def on_train_start(self) -> None:
        if self.global_rank == 1:
            raise RuntimeError("on_train_start failed on rank 1")


def test_a_rank_whose_fit_raises_is_reported_with_its_error_and_nothing_waits_for_it():
    start = time.monotonic()
    report = run_conformance(
        RaisesOnRankOne, processes=2, start_method=FORK, checks=["lifecycle", "reduce"], timeout=120
    )
    # A hang bound, not a speed claim: nothing waited for the failed rank until the 120 s timeout.
    assert time.monotonic() - start < 120
    assert [result.label for result in report.failures] == ["trainer/lifecycle", "trainer/reduce", "cohort/lifecycle"]
    lifecycle, reduce = report["trainer", "lifecycle"].message, report["reduce"].message
    assert (
        "on rank 1: did not finish: Trainer.fit raised RuntimeError on rank 1" in report["cohort", "lifecycle"].message
    )
    assert "on rank 1:\n  Trainer.fit raised RuntimeError: on_train_start failed on rank 1" in lifecycle
    assert (
        "on rank 0: Trainer.fit ended this rank with SystemExit(1): the strategy stopped it because another rank failed"
        in lifecycle
    )
    assert (
        "on rank 1: did not finish: Trainer.fit raised RuntimeError on rank 1; the remaining checks did not run."
        in reduce
    )


def _not_a_strategy() -> Any:
    return object()


@pytest.mark.parametrize(
    ("make_strategy", "text"),
    [
        (
            partial(DDPStrategy, start_method="spawn"),
            "DDPStrategy would start processes itself (MultiProcessingLauncher)",
        ),
        (_not_a_strategy, "make_strategy returned object; it must return a phalanx.strategies.Strategy instance."),
    ],
)
def test_a_strategy_the_kit_cannot_run_fails_every_check_saying_why(make_strategy, text):
    report = run_conformance(make_strategy, processes=2, start_method=FORK, checks=["lifecycle", "reduce"], timeout=60)
    assert [result.label for result in report.failures] == ["trainer/lifecycle", "trainer/reduce", "cohort/lifecycle"]
    for key in report.results:
        assert text in report[key].message
