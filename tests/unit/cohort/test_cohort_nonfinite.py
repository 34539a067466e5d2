"""The Cohort warns once when a loss given to cohort.backward was NaN or infinite, read only where it reads or waits
anyway (save, barrier, log), as the Trainer's default nonfinite_loss='warn' does."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import phalanx
from phalanx.loggers import CSVLogger

MESSAGE = "was NaN or infinite at least once"


def run(tmp_path, losses: list[float], where: str) -> list[str]:
    cohort = phalanx.Cohort(accelerator="cpu", devices=1, loggers=CSVLogger(str(tmp_path)))
    layer = nn.Linear(2, 1)
    model, optimizer = cohort.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in losses:
            optimizer.zero_grad()
            cohort.backward(model(torch.ones(1, 2)).sum() * 0 + value)
            optimizer.step()
        for _ in range(2):  # reported once per Cohort
            if where == "save":
                cohort.save(tmp_path / "state.ckpt", {"model": model})
            elif where == "barrier":
                cohort.barrier()
            else:
                cohort.log("loss", 1.0)
    return [str(w.message) for w in caught if MESSAGE in str(w.message)]


@pytest.mark.parametrize("where", ["save", "barrier", "log"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_warns_once_at_the_next_save_barrier_or_log(tmp_path, where, bad):
    messages = run(tmp_path, [1.0, bad, 2.0], where)
    assert len(messages) == 1
    assert f"Cohort.{where}" in messages[0] and "empty_init" in messages[0]


@pytest.mark.parametrize("where", ["save", "barrier", "log"])
def test_finite_losses_do_not_warn(tmp_path, where):
    assert run(tmp_path, [1.0, 2.0, 1e30], where) == []


def test_backward_reads_nothing_on_the_host(monkeypatch):
    cohort = phalanx.Cohort(accelerator="cpu", devices=1)
    layer = nn.Linear(2, 1)
    model, _ = cohort.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.0))

    def refuse(*args, **kwargs):
        raise AssertionError("cohort.backward read a tensor on the host")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    cohort.backward(model(torch.ones(1, 2)).sum() * math.nan)
