"""Splitting a model into pipeline stages by its repeated blocks: balanced or at split points, names kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from phalanx.strategies.pipeline_split import keep_stage, keep_stages, stage_ranges, stage_views


@pytest.mark.parametrize(
    ("blocks", "stages", "points", "expected"),
    [
        (4, 2, None, [(0, 2), (2, 4)]),
        (5, 2, None, [(0, 3), (3, 5)]),
        (7, 3, None, [(0, 3), (3, 5), (5, 7)]),
        (3, 3, None, [(0, 1), (1, 2), (2, 3)]),
        (1, 1, None, [(0, 1)]),
        (6, 2, [1], [(0, 1), (1, 6)]),
        (6, 3, [2, 5], [(0, 2), (2, 5), (5, 6)]),
    ],
)
def test_blocks_are_dealt_to_stages(blocks, stages, points, expected):
    ranges = stage_ranges(blocks, stages, points)
    assert [(r.start, r.stop) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(blocks))  # every block once, in order


@pytest.mark.parametrize(
    ("blocks", "stages", "points", "message"),
    [
        (2, 3, None, "num_stages=3 is more than the 2 blocks"),
        (0, 1, None, "num_blocks=0 must be an int >= 1"),
        (4, 0, None, "num_stages=0 must be an int >= 1"),
        (4, 2, [1, 2], r"split_points=\[1, 2\] must give 1 indices for 2 stages"),
        (4, 3, [2, 2], "must be increasing ints strictly between 0 and 4"),
        (4, 2, [4], "must be increasing ints strictly between 0 and 4"),
        (4, 2, [0], "must be increasing ints strictly between 0 and 4"),
        (4, 2, [1.5], "must be increasing ints"),
    ],
)
def test_impossible_splits_are_refused(blocks, stages, points, message):
    with pytest.raises(ValueError, match=message):
        stage_ranges(blocks, stages, points)


class Tiny(nn.Module):
    """Embedding, repeated blocks, norm and head; each part runs only where the stage holds it."""

    def __init__(self, blocks: int = 5, container: type = nn.ModuleList) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(11, 8)
        layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks)]
        self.layers = nn.ModuleList(layers) if container is nn.ModuleList else nn.Sequential(*layers)
        self.norm: nn.Module | None = nn.LayerNorm(8)
        self.head: nn.Module | None = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers:
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


@pytest.mark.parametrize(
    ("stages", "points", "container"),
    [(2, None, nn.ModuleList), (3, None, nn.Sequential), (2, [4], nn.ModuleList), (5, None, nn.Sequential)],
)
def test_stages_hold_disjoint_parts_that_chain_into_the_whole_model(stages, points, container):
    torch.manual_seed(0)
    whole = Tiny(container=container)
    tokens = torch.randint(0, 11, (4, 6))
    expected = whole(tokens)
    names: list[str] = []
    x = tokens
    for stage in range(stages):
        part = copy.deepcopy(whole)
        held = keep_stage(part, "layers", stage, stages, split_points=points, first=["embed"], last=["norm", "head"])
        assert len(part.layers) == len(held)
        names += [name for name, _ in part.named_parameters()]
        x = part(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    # The stages' parameters, under the whole model's names, are the whole model's, each once.
    assert sorted(names) == sorted(name for name, _ in whole.named_parameters())


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"blocks": "head", "stage": 0}, TypeError, "'head' is a Linear; name the nn.ModuleList or nn.Sequential"),
        ({"blocks": "layers", "stage": 2}, ValueError, "stage=2 must be an int from 0 to 1"),
        ({"blocks": "layers", "stage": 0, "last": ["tail"]}, AttributeError, "tail"),
        ({"blocks": "missing", "stage": 0}, AttributeError, "missing"),
    ],
)
def test_wrong_names_and_stages_are_refused_before_anything_is_removed(arguments, error, message):
    module = Tiny()
    before = [name for name, _ in module.named_parameters()]
    with pytest.raises(error, match=message):
        keep_stage(module, num_stages=2, **arguments)
    assert [name for name, _ in module.named_parameters()] == before


@pytest.mark.parametrize(("again", "refused"), [((1, 2), False), ((0, 2), True), ((1, 3), True)])
def test_a_split_stays_when_configure_model_runs_again(again, refused):
    # configure_model runs once per stage of a run (fit, then validate or predict) on the same module.
    module = Tiny()
    held = keep_stage(module, "layers", 1, 2, first=["embed"], last=["norm", "head"])
    names = [name for name, _ in module.named_parameters()]
    if refused:
        with pytest.raises(ValueError, match="The module already holds stage 1 of 2"):
            keep_stage(module, "layers", *again, first=["embed"], last=["norm", "head"])
    else:
        assert keep_stage(module, "layers", *again, first=["embed"], last=["norm", "head"]) == held
    assert [name for name, _ in module.named_parameters()] == names


@pytest.mark.parametrize(
    ("held", "num_stages"), [([(0, 2), (1, 3)], 4), ([(0, 3), (1, 2)], 4), ([(0, 2, 4), (1, 3, 5)], 6)]
)
def test_virtual_stages_give_one_view_per_stage_that_chain_into_the_whole_model(held, num_stages):
    torch.manual_seed(0)
    whole = Tiny(blocks=6)
    tokens = torch.randint(0, 11, (4, 6))
    expected = whole(tokens)
    views = {}
    for stages in held:  # one rank per tuple, each holding several stages
        part = copy.deepcopy(whole)
        keep_stages(part, "layers", stages, num_stages, first=["embed"], last=["norm", "head"])
        assert keep_stages(part, "layers", stages, num_stages, first=["embed"], last=["norm", "head"])  # again: kept
        names = {name for name, _ in part.named_parameters()}
        for stage, view in zip(stages, stage_views(part)):
            views[stage] = view
            # A view shares the rank's parameters (no copy) and holds only its own stage's.
            assert {name for name, _ in view.named_parameters()} <= names
            assert all(any(p is q for q in part.parameters()) for p in view.parameters())
    x = tokens
    for stage in range(num_stages):
        x = views[stage](x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
