"""A TrainingModule set up by a Cohort answers its rank questions from that Cohort, as it does from a Trainer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.cohort.metrics import attach


class Module(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class StandInStrategy:
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return torch.stack([tensor, tensor + 10])


class StandInCohort:
    """What a Cohort of rank 3 (local rank 1) on a 4-process job looks like to the module."""

    global_rank, local_rank, global_step, is_global_zero = 3, 1, 7, False
    strategy = StandInStrategy()
    loggers: list[Any] = ["csv", "tensorboard"]
    logger = "csv"


@pytest.mark.parametrize(
    ("attribute", "expected", "unattached"),
    [
        ("global_rank", 3, 0),
        ("local_rank", 1, 0),
        ("global_step", 7, 0),
        ("loggers", ["csv", "tensorboard"], []),
        ("logger", "csv", None),
    ],
)
def test_rank_questions_reach_the_cohort(attribute: str, expected: Any, unattached: Any) -> None:
    module = Module()
    assert getattr(module, attribute) == unattached
    cohort = StandInCohort()
    attach(module, cohort)
    assert getattr(module, attribute) == expected


def test_print_is_silent_off_rank_zero_and_all_gather_uses_the_cohorts_strategy(capsys) -> None:
    module, cohort = Module(), StandInCohort()
    attach(module, cohort)
    module.print("from rank 3")
    assert capsys.readouterr().out == ""
    gathered = module.all_gather({"x": torch.tensor([1.0])})
    assert torch.equal(gathered["x"], torch.tensor([[1.0], [11.0]]))


def test_all_gather_without_trainer_or_cohort_names_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="needs a running Trainer or a Cohort"):
        Module().all_gather(torch.ones(1))


def test_a_real_cohort_on_one_device(capsys) -> None:
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)
    module = Module()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    module.print("rank zero prints")
    assert capsys.readouterr().out == "rank zero prints\n"
    assert module.global_rank == 0 and module.global_step == 0
    optimizer.zero_grad()
    cohort.backward(model(torch.ones(4, 2)).sum())
    optimizer.step()
    assert module.global_step == cohort.global_step == 1
    assert module.all_gather(torch.tensor([2.0])).tolist() == [2.0]  # one process: returned as is, as in Lightning
