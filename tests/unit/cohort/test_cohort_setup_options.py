"""Fabric's ``setup`` options on a Cohort: ``move_to_device=`` and ``setup(module)`` without an optimizer where the
strategy needs both (DeepSpeed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.cohort import CohortModule
from phalanx.strategies import SingleDeviceStrategy


class _OneEngineStrategy(SingleDeviceStrategy):
    """Like DeepSpeed: sets up the module together with its optimizers."""

    @property
    def wraps_module_with_optimizers(self) -> bool:
        return True


class _ElsewhereStrategy(SingleDeviceStrategy):
    """Runs on another device than the module's (only the placement check looks at it here)."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cuda", 0)


def _strategy(name: str) -> Any:
    cpu = torch.device("cpu")
    if name == "deepspeed_stage_2":
        pytest.importorskip("deepspeed")
        from phalanx.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=2, parallel_devices=[cpu])
    return {"one engine": _OneEngineStrategy, "single_device": SingleDeviceStrategy}[name](device=cpu)


@pytest.mark.parametrize(
    ("strategy", "refused"), [("one engine", True), ("deepspeed_stage_2", True), ("single_device", False)]
)
def test_setup_without_an_optimizer_says_what_to_pass_where_the_strategy_needs_both(strategy, refused):
    cohort = phalanx.Cohort(accelerator="cpu", strategy=_strategy(strategy))
    module = nn.Linear(2, 1)
    if not refused:
        assert isinstance(cohort.setup(module), CohortModule)
        return
    with pytest.raises(ValueError, match=r"was given no optimizer, but \w+ builds one engine") as error:
        cohort.setup(module)
    assert "Pass the optimizer too: model, optimizer = cohort.setup(module, optimizer)." in str(error.value)


@pytest.mark.parametrize("method", ["setup", "setup_module"])
@pytest.mark.parametrize(
    ("strategy", "module_device", "move_to_device", "refused"),
    [
        ("single_device", "cpu", True, False),
        ("single_device", "cpu", False, False),  # already where the strategy places it: nothing moves
        ("elsewhere", "cpu", False, True),  # the strategy would move it: refused rather than ignored
    ],
)
def test_move_to_device_false_is_taken_where_nothing_moves(method, strategy, module_device, move_to_device, refused):
    kind = _ElsewhereStrategy if strategy == "elsewhere" else SingleDeviceStrategy
    cohort = phalanx.Cohort(accelerator="cpu", strategy=kind(device=torch.device("cpu")))
    module = nn.Linear(2, 1, device=module_device)
    optimizers = (torch.optim.SGD(module.parameters(), lr=0.1),) if method == "setup" else ()
    if refused:
        with pytest.raises(ValueError, match=rf"Cohort.{method}\(move_to_device=False\): the module has tensors on"):
            getattr(cohort, method)(module, *optimizers, move_to_device=move_to_device)
        return
    set_up = getattr(cohort, method)(module, *optimizers, move_to_device=move_to_device)
    model = set_up[0] if method == "setup" else set_up
    assert {p.device.type for p in model.parameters()} == {module_device}


@pytest.mark.parametrize("value", [None, 0, "no"])
def test_move_to_device_takes_true_or_false(value):
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device")
    with pytest.raises(TypeError, match=rf"Cohort.setup\(move_to_device={value!r}\) must be True or False"):
        cohort.setup(nn.Linear(2, 1), move_to_device=value)
