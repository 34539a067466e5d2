"""One set-up skeleton: Strategy.setup owns the order, strategies override its named steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx.strategies
from phalanx.accelerators import CPUAccelerator
from phalanx.strategies import STRATEGY_REGISTRY, RunSettings, SingleDeviceStrategy, Strategy


def _sgd(module: nn.Module) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    return [torch.optim.SGD(module.parameters(), lr=0.1)], []


_REGISTERED = {STRATEGY_REGISTRY.get_class(name) for name in STRATEGY_REGISTRY.available()}
_EXPORTED = {
    value
    for value in vars(phalanx.strategies).values()
    if isinstance(value, type) and issubclass(value, Strategy) and value is not Strategy
}


@pytest.mark.parametrize(
    "cls",
    sorted(_REGISTERED | _EXPORTED, key=lambda cls: cls.__name__),
    ids=lambda cls: cls.__name__,
)
def test_no_built_in_strategy_defines_setup(cls: type) -> None:
    assert cls.setup is Strategy.setup


class Recording(SingleDeviceStrategy):
    """Records each step's name; the base class does the work."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"), accelerator=CPUAccelerator())
        self.steps: list[str] = []

    def prepare_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        self.steps.append("prepare_module")
        return super().prepare_module(module, settings)

    def place_module(self, settings: RunSettings) -> None:
        self.steps.append("place_module")
        super().place_module(settings)

    def wrap_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        self.steps.append("wrap_module")
        return super().wrap_module(module, settings)

    def setup_optimizers(self, settings: RunSettings) -> None:
        self.steps.append("setup_optimizers")
        super().setup_optimizers(settings)

    def setup_precision_plugin(self) -> None:
        self.steps.append("setup_precision_plugin")
        super().setup_precision_plugin()

    def finish_setup(self, settings: RunSettings) -> None:
        self.steps.append("finish_setup")


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ("fit", ["prepare_module", "place_module", "wrap_module", "setup_optimizers", "setup_precision_plugin"]),
        ("validate", ["prepare_module", "place_module", "wrap_module", "setup_precision_plugin"]),
        ("test", ["prepare_module", "place_module", "wrap_module", "setup_precision_plugin"]),
        ("predict", ["prepare_module", "place_module", "wrap_module", "setup_precision_plugin"]),
    ],
)
def test_setup_runs_the_steps_in_order(stage: str, expected: list[str]) -> None:
    strategy = Recording()
    strategy.connect(nn.Linear(2, 2))
    strategy.setup(RunSettings(stage=stage, configure_optimizers=_sgd))
    assert strategy.steps == [*expected, "finish_setup"]
    assert len(strategy.optimizers) == (1 if stage == "fit" else 0)


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class WrapsOnly(SingleDeviceStrategy):
    def wrap_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        return Wrapper(module)


def test_wrap_module_gives_the_model_and_keeps_the_module() -> None:
    strategy = WrapsOnly(device=torch.device("cpu"), accelerator=CPUAccelerator())
    module = nn.Linear(2, 2)
    strategy.connect(module)
    strategy.setup(RunSettings(configure_optimizers=_sgd))
    assert isinstance(strategy.model, Wrapper) and strategy.model.inner is module
    assert strategy.module is module
    assert strategy.optimizers[0].param_groups[0]["params"][0] is module.weight


class OldStyle(SingleDeviceStrategy):
    """An out-of-tree strategy written against the previous contract."""

    def setup(self, settings: RunSettings) -> None:
        self._begin_setup(settings)
        self.model_to_device()
        self.setup_optimizers(settings)
        self.setup_precision_plugin()


def test_begin_setup_still_works_and_names_its_replacement() -> None:
    strategy = OldStyle(device=torch.device("cpu"), accelerator=CPUAccelerator())
    strategy.connect(nn.Linear(2, 2))
    with pytest.warns(
        DeprecationWarning,
        match=r"_begin_setup.*override its steps instead \(check_setup, prepare_module, place_module",
    ):
        strategy.setup(RunSettings(configure_optimizers=_sgd))
    assert len(strategy.optimizers) == 1


@pytest.mark.parametrize(
    "step",
    ["check_setup", "prepare_module", "place_module", "wrap_module", "wrap_module_and_optimizers", "finish_setup"],
)
def test_every_step_has_a_docstring(step: str) -> None:
    assert getattr(Strategy, step).__doc__
