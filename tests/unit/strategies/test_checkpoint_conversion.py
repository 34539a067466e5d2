"""Converting a checkpoint of another layout for DeepSpeed: what is refused, and that each refusal names the checkpoint,
both layouts and what to do (no processes, no deepspeed needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.strategies.deepspeed._conversion import single_optimizer_state, source_layout, split_group_state
from phalanx.utilities.exceptions import CheckpointError

SOURCE, PATH, TARGET = "a single-file checkpoint", "/runs/step=5.ckpt", "DeepSpeed ZeRO stage 3 on 2 processes"
WHERE = dict(source=SOURCE, path=PATH, target=TARGET)


def _adam(steps: list[float], shapes: list[tuple[int, ...]], groups: list[list[int]]) -> dict[str, Any]:
    state = {
        index: {"step": torch.tensor(step), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.ones(shape)}
        for index, (step, shape) in enumerate(zip(steps, shapes))
    }
    return {"state": state, "param_groups": [{"lr": 0.01, "params": params} for params in groups]}


PARAMS = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    ("states", "optimizers", "expected"),
    [
        (None, 1, ["holds no optimizer state", "phalanx checkpoint consolidate", "fit without ckpt_path"]),
        ([], 1, ["holds no optimizer state", "load_from_checkpoint"]),
        ([{}, {}], 1, ["2 optimizer states", "DeepSpeed drives 1", "same configure_optimizers"]),
        ([{"stored_by": "deepspeed"}], 1, ["not in torch's optimizer.state_dict() layout", "consolidate"]),
    ],
)
def test_a_checkpoint_without_a_usable_optimizer_state_is_refused(states, optimizers, expected):
    with pytest.raises(CheckpointError) as error:
        single_optimizer_state(states, optimizers=optimizers, **WHERE)
    message = str(error.value)
    for part in [SOURCE, PATH, TARGET, *expected]:
        assert part in message


@pytest.mark.parametrize(
    ("saved", "expected"),
    [
        (_adam([5, 5], [(3, 2), (3,)], [[0], [1]]), ["parameter groups of [1, 1]", "[2]", "same model"]),
        (_adam([5], [(3, 2)], [[0, 1]]), ["parameter 1 of group 0 has no optimizer state", "never stepped"]),
        (_adam([5, 5], [(3, 2), (4,)], [[0, 1]]), ["'exp_avg' of parameter 1 has 4 elements", "parameter 3"]),
        (_adam([5, 4], [(3, 2), (3,)], [[0, 1]]), ["different 'step'", "one per group", "(ddp, fsdp)"]),
    ],
)
def test_an_optimizer_state_that_does_not_fit_the_engine_is_refused(saved, expected):
    with pytest.raises(CheckpointError) as error:
        split_group_state(saved, [PARAMS], **WHERE)
    message = str(error.value)
    for part in [SOURCE, PATH, TARGET, *expected]:
        assert part in message


def test_a_fitting_state_splits_into_per_parameter_tensors_and_shared_scalars():
    saved = _adam([5, 5], [(3, 2), (3,)], [[0, 1]])
    [(hyper, per_element, scalars)] = split_group_state(saved, [PARAMS], **WHERE)
    assert hyper == {"lr": 0.01}
    assert [sorted(entry) for entry in per_element] == [["exp_avg", "exp_avg_sq"]] * 2
    assert per_element[1]["exp_avg_sq"].shape == (3,)
    assert float(scalars["step"]) == 5.0


@pytest.mark.parametrize(
    ("kind", "meta", "expected"),
    [
        ("file", None, "a single-file checkpoint"),
        ("directory", None, "a sharded (DCP) checkpoint directory"),
        ("directory", {"directory": "d", "zero_stage": 2, "world_size": 2}, "ZeRO stage 2 directory written by 2"),
        ("directory", {"directory": "d", "zero_stage": 1}, "a DeepSpeed ZeRO stage 1 directory"),
    ],
)
def test_layouts_are_named_in_words(tmp_path: Path, kind, meta, expected):
    path = tmp_path / "x.ckpt"
    path.mkdir() if kind == "directory" else path.write_bytes(b"")
    assert expected in source_layout(path, meta)
