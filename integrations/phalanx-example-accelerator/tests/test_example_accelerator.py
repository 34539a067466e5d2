"""The example package as a user meets it: names that resolve through entry points, a fit, and the error without it."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from phalanx_example_accelerator import ExampleCPUAccelerator, ExampleStrategy
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.accelerators import ACCELERATOR_REGISTRY, CPUAccelerator
from phalanx.strategies import STRATEGY_REGISTRY

PACKAGE = "phalanx_example_accelerator"


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=generator)
    return DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])), batch_size=16)


def _trainer(**kwargs) -> phalanx.Trainer:
    options = dict(max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return phalanx.Trainer(**{**options, "enable_model_summary": False, **kwargs})


@pytest.mark.parametrize(
    ("registry", "name", "cls"),
    [
        (ACCELERATOR_REGISTRY, "example_cpu", ExampleCPUAccelerator),
        (STRATEGY_REGISTRY, "EXAMPLE_SINGLE_DEVICE", ExampleStrategy),
    ],
)
def test_entry_points_register_the_names(registry, name, cls) -> None:
    assert name in registry
    assert registry.get_class(name) is cls
    assert "example package" in registry.description(name)
    assert name.lower() in registry.available()


def test_selected_by_name_it_trains_on_the_example_accelerator() -> None:
    trainer = _trainer(accelerator="example_cpu", strategy="example_single_device")
    strategy = trainer.strategy
    assert type(strategy) is ExampleStrategy
    assert type(strategy.accelerator) is ExampleCPUAccelerator
    module = Regressor()
    trainer.fit(module, _data())
    assert trainer.global_step == 48
    assert sum(module.losses[-4:]) < 0.05 * sum(module.losses[:4])
    # One run: the device was set up once, the accelerator set up and torn down once, as the contract says.
    assert strategy.accelerator.calls == {"setup_device": 1, "setup": 1, "teardown": 1}
    assert strategy.accelerator.get_device_stats(strategy.root_device)["example_cpu/setup_device"] == 1
    assert [settings.stage for settings in strategy.settings] == ["fit"]


@pytest.mark.parametrize(
    ("accelerator", "expected"),
    [("example_cpu", ExampleCPUAccelerator), ("cpu", CPUAccelerator), ("auto", CPUAccelerator)],
)
def test_the_accelerator_name_and_the_strategy_name_combine(accelerator, expected) -> None:
    trainer = _trainer(accelerator=accelerator, strategy="example_single_device")
    assert type(trainer.strategy) is ExampleStrategy
    assert type(trainer.strategy.accelerator) is expected


def test_example_accelerator_under_another_strategy() -> None:
    trainer = _trainer(accelerator="example_cpu", strategy="single_device", max_epochs=1)
    trainer.fit(Regressor(), _data())
    assert trainer.strategy.accelerator.calls["setup_device"] == 1


def test_cohort_resolves_the_names_too() -> None:
    cohort = phalanx.Cohort(accelerator="example_cpu", strategy="example_single_device")
    net = torch.nn.Linear(4, 1)
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert type(cohort.strategy.accelerator) is ExampleCPUAccelerator
    assert next(model.parameters()).device.type == "cpu"


def test_the_strategy_conforms() -> None:
    from phalanx.testing import check_strategy

    check_strategy(ExampleStrategy, processes=1, start_method="fork")


@pytest.fixture
def without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """phalanx as it is when this package is not installed: its entry points are gone and nothing is registered."""
    every_entry_point = importlib.metadata.entry_points

    def entry_points(**params):
        return [ep for ep in every_entry_point(**params) if not ep.value.startswith(PACKAGE)]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    for registry in (ACCELERATOR_REGISTRY, STRATEGY_REGISTRY):
        # Back to phalanx's own names; the entry points (this package's now hidden) load again on the next lookup.
        kept = {k: v for k, v in registry._entries.items() if v["factory"].__module__.startswith("phalanx.")}
        monkeypatch.setattr(registry, "_entries", kept)
        monkeypatch.setattr(registry, "_plugins", {})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(accelerator="example_cpu"), "Unknown accelerator 'example_cpu'. Choose one of ['auto', 'gpu', 'cpu',"),
        (
            dict(strategy="example_single_device"),
            "Unknown strategy 'example_single_device'. Did you mean 'single_device'? Choose 'auto' or one of",
        ),
    ],
)
def test_without_the_package_the_names_are_unknown(without_the_package, arguments, message) -> None:
    with pytest.raises(ValueError) as error:
        _trainer(**arguments)
    assert message in str(error.value)
    assert "single_device" in str(error.value) or "'cuda'" in str(error.value)  # the known names are listed
    assert "example" not in str(error.value).split("Choose")[1]
