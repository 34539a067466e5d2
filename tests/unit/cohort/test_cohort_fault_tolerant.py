"""The Cohort on strategy='ddp_ft' in this process (one replica group, a lighthouse here too): what it refuses, and a
step that the quorum declines (torchft's ``report_error``, as a peer's failure records it) changes nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest
import torch
from phalanx_distributed import free_port
from torch import nn

from phalanx import Cohort
from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance

pytest.importorskip("torchft")


@pytest.fixture
def make_cohort(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Cohort]]:
    """Cohorts on ddp_ft as replica group 0 of 1, each with a lighthouse of its own; all released afterwards."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    made: list[tuple[Any, Cohort]] = []

    def make() -> Cohort:
        lighthouse = start_lighthouse(join_timeout=timedelta(milliseconds=20), quorum_tick=timedelta(milliseconds=10))
        options = FaultTolerance(0, 1, lighthouse=lighthouse.address)
        cohort = Cohort(strategy=DDPFaultTolerantStrategy(fault_tolerance=options), accelerator="cpu", devices=1)
        made.append((lighthouse, cohort))
        cohort.launch()  # one process: nothing to start, its process group is set up
        return cohort

    yield make
    for lighthouse, cohort in made:
        cohort.strategy.teardown()  # leaves the quorum service; the Cohort itself never tears its strategy down
        lighthouse.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the strategy's, as DDP leaves it


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _two_optimizers(cohort: Cohort) -> None:
    model = _model()
    cohort.setup(model, torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1))


def _lbfgs(cohort: Cohort) -> None:
    model = _model()
    cohort.setup(model, torch.optim.LBFGS(model.parameters()))


def _set_up(cohort: Cohort) -> Cohort:
    model = _model()
    cohort.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return cohort


REFUSALS = [
    (_two_optimizers, ValueError, r"one optimizer per step \(one commit vote\), got 2; combine their parameter groups"),
    (_lbfgs, ValueError, r"cannot step LBFGS, which re-evaluates its closure.*Use an optimizer such as SGD or AdamW"),
    (lambda cohort: cohort.start_training({"step": 0}), RuntimeError, r"needs a set-up module: call cohort\.setup"),
    (lambda cohort: _set_up(cohort).start_training([0]), TypeError, r"takes a dict of the loop's integer counters"),
    (lambda cohort: _set_up(cohort).start_training({"step": 1.5}), ValueError, r"\['step'\] must be names \(str\)"),
    (lambda cohort: _set_up(cohort).start_training({1: 0}), ValueError, r"\[1\] must be names \(str\) of integer"),
    (lambda cohort: _set_up(cohort).start_training({"global_step": 0}), ValueError, r"sent with it already"),
]


@pytest.mark.parametrize(("call", "error", "message"), REFUSALS)
def test_what_the_cohort_cannot_run_fault_tolerantly_is_refused_naming_the_alternative(
    make_cohort, call, error, message
):
    with pytest.raises(error, match=message):
        call(make_cohort())


def test_a_declined_step_changes_nothing_and_is_not_counted(make_cohort):
    cohort = make_cohort()
    plain = _model()
    model, optimizer = cohort.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    position = {"step": 0}
    cohort.start_training(position)
    committed: list[bool] = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        cohort.backward(model(torch.ones(2, 3)).pow(2).mean())
        if step == 1:  # what torchft records when a peer fails during the step's all-reduce
            cohort.strategy.manager.report_error(RuntimeError("a peer left during the all-reduce"))
        optimizer.step()
        committed.append(cohort.last_step_committed)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == cohort.last_step_committed
    assert committed == [True, False, True]
    assert cohort.global_step == 2
    assert cohort.strategy.manager.current_step() == 2  # torchft's count of committed steps agrees
