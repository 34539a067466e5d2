"""Optimizer states keyed by parameter name: saved from one optimizer, loaded into another over the same model or a
part of it (a pipeline stage), and the refusals; a state keyed by position for the whole model, named by the stages
together (what a pipeline resuming a checkpoint written without one does)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from phalanx.strategies.pipeline_split import keep_stages
from phalanx.utilities.optimizer_names import (
    check_state_shapes,
    groups_in_order,
    is_keyed_by_name,
    name_positions,
    order_keys,
    state_by_name,
    state_by_position,
)


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


class Staged(nn.Module):
    """An embedding-like first part, five numbered blocks and a head: what a pipeline's ranks split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed: nn.Module | None = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(5))
        self.head: nn.Module | None = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


#: How the ranks of a pipeline hold the stages: each rank's stage indices, and the number of stages.
SPLITS = {
    "two_ranks": ([(0,), (1,)], 2),
    "three_ranks": ([(0,), (1,), (2,)], 3),
    "virtual_stages": ([(0, 2), (1, 3)], 4),
}


def _stages(ranks: list[tuple[int, ...]], num_stages: int) -> list[nn.Module]:
    parts = []
    for stages in ranks:
        part = Staged()
        keep_stages(part, "blocks", stages, num_stages, first=["embed"], last=["head"])
        parts.append(part)
    return parts


def _whole_order(parts: list[nn.Module], group_of: dict[str, int], groups: int) -> list[list[str]]:
    # What each rank sends (per group, its names with their order keys), and what they make together.
    listed = []
    for part in [*parts, parts[0]]:  # a data-parallel replica of the first stage lists its names again
        keys = order_keys(part)
        listed.append([[(name, key) for name, key in keys.items() if group_of[name] == g] for g in range(groups)])
    return groups_in_order(listed)


@pytest.mark.parametrize("split", list(SPLITS))
def test_the_stages_order_keys_sort_as_the_whole_models_parameters(split):
    parts = _stages(*SPLITS[split])
    whole = [name for name, _ in Staged().named_parameters()]
    assert _whole_order(parts, dict.fromkeys(whole, 0), 1) == [whole]
    assert sum(len(order_keys(part)) for part in parts) == len(whole)  # each stage lists only what it holds


def _decay_groups(model: nn.Module) -> list[dict]:
    # Weight decay on matrices only: two groups, each in the module's order (as such groups are usually built).
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "decay_groups"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_whole_models_state_by_position_loads_into_each_stage(split, grouped):
    whole = Staged()
    optimizer = torch.optim.AdamW(_decay_groups(whole) if grouped else whole.parameters(), lr=0.01)
    whole(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    names = {id(p): name for name, p in whole.named_parameters()}
    group_of = {names[id(p)]: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    parts = _stages(*SPLITS[split])
    named = name_positions(optimizer.state_dict(), _whole_order(parts, group_of, len(optimizer.param_groups)))
    for part in parts:
        local = torch.optim.AdamW(_decay_groups(part) if grouped else part.parameters(), lr=0.01)
        check_state_shapes(local, part, named)
        local.load_state_dict(state_by_position(local, part, named))
        original = dict(whole.named_parameters())
        for name, parameter in part.named_parameters():
            expected = optimizer.state[original[name]]
            torch.testing.assert_close(local.state[parameter]["exp_avg_sq"], expected["exp_avg_sq"])


def test_positions_named_in_another_order_than_the_optimizers_are_refused():
    whole = Staged()
    optimizer = torch.optim.AdamW(reversed(list(whole.parameters())), lr=0.01)  # not the module's order
    whole(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    named = name_positions(optimizer.state_dict(), [[name for name, _ in whole.named_parameters()]])
    with pytest.raises(ValueError, match="List the parameters in each group in the module's order"):
        check_state_shapes(optimizer, whole, named)


def test_groups_of_other_sizes_are_refused():
    whole = Staged()
    state = torch.optim.SGD(whole.parameters(), lr=0.1).state_dict()
    with pytest.raises(ValueError, match=re.escape("parameter groups of [24] parameters")):
        name_positions(state, [["embed.weight"]])
