"""Optimizer states keyed by parameter name: saved from one optimizer, loaded into another over the same model or a
part of it (a pipeline stage), and the refusals."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from phalanx.utilities.optimizer_names import is_keyed_by_name, state_by_name, state_by_position


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _groups(model: nn.Module, split: bool) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}] if split else [{"params": params}]


OPTIMIZERS = {
    "SGD_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=0.01),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
}


def _stepped(name: str, split: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = OPTIMIZERS[name](_groups(model, split))
    model(torch.ones(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_state_by_name_loads_into_a_fresh_optimizer_as_the_original(name, split):
    model, optimizer = _stepped(name, split)
    saved = state_by_name(optimizer, model)
    assert is_keyed_by_name(saved) and set(saved["state"]) == {n for n, _ in model.named_parameters()}
    fresh_model = _model()
    fresh = OPTIMIZERS[name](_groups(fresh_model, split))
    fresh.load_state_dict(state_by_position(fresh, fresh_model, saved))
    expected, found = optimizer.state_dict(), fresh.state_dict()
    assert found["param_groups"] == expected["param_groups"]
    for pid, entries in expected["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(found["state"][pid][key], value)


def test_a_part_of_the_model_takes_its_own_parameters_states():
    model, optimizer = _stepped("AdamW", split=False)
    saved = state_by_name(optimizer, model)
    # A stage holding only the last layer, under the whole model's names.
    stage = _model()
    stage[0] = nn.Identity()
    part = torch.optim.AdamW(stage.parameters(), lr=0.01)
    part.load_state_dict(state_by_position(part, stage, saved))
    torch.testing.assert_close(part.state_dict()["state"][0]["exp_avg"], optimizer.state[model[2].weight]["exp_avg"])
    torch.testing.assert_close(part.state_dict()["state"][1]["exp_avg"], optimizer.state[model[2].bias]["exp_avg"])


def test_a_state_by_position_passes_through_unchanged():
    model, optimizer = _stepped("SGD_momentum", split=False)
    state = optimizer.state_dict()
    assert not is_keyed_by_name(state) and state_by_position(optimizer, model, state) is state


REFUSALS = {
    "groups": (lambda model: torch.optim.SGD(_groups(model, True), lr=0.1), "1 parameter group(s)"),
    "names": (lambda model: torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1), "no entry for the parameters"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_state_that_does_not_fit_is_refused(case):
    model, optimizer = _stepped("SGD_momentum", split=False)
    saved = state_by_name(optimizer, model)
    make, message = REFUSALS[case]
    target = make(model) if case == "groups" else make(None)
    with pytest.raises(ValueError, match=re.escape(message)):
        state_by_position(target, model, saved)


def test_an_optimizer_over_foreign_parameters_cannot_be_keyed_by_name():
    model = _model()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="positions \\[4\\] that are not parameters"):
        state_by_name(optimizer, model)
