"""DeepSpeedStrategy's activation checkpointing arguments (Lightning's): the config section they make, how they meet
an explicit config, and the call to deepspeed.checkpointing.configure. No DeepSpeed engine is built."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import phalanx
import phalanx.strategies.deepspeed.strategy as deepspeed_module
from phalanx.strategies import DeepSpeedStrategy, RunSettings
from phalanx.strategies.deepspeed._activation import configure_activation_checkpointing
from phalanx.strategies.deepspeed.strategy import CONFIG_ENV_VAR


@pytest.fixture(autouse=True)
def _deepspeed_installed(monkeypatch):
    monkeypatch.setattr(deepspeed_module, "deepspeed_available", lambda: True)
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


FIT = RunSettings(stage="fit", configure_optimizers=lambda module: ([], []))


GENERATED = [
    # (arguments, the activation_checkpointing section of the generated config; None: no section)
    ({}, None),
    ({"partition_activations": True}, {"partition_activations": True}),
    (
        {"partition_activations": True, "cpu_checkpointing": True},
        {"partition_activations": True, "cpu_checkpointing": True},
    ),
    ({"synchronize_checkpoint_boundary": True}, {"synchronize_checkpoint_boundary": True}),
    ({"cpu_checkpointing": False, "partition_activations": False}, None),
]


@pytest.mark.parametrize(("arguments", "section"), GENERATED)
def test_arguments_make_the_config_section(arguments, section):
    strategy = DeepSpeedStrategy(**arguments)
    for config in (strategy.config, strategy._build_config(FIT)):
        assert config.get("activation_checkpointing") == section
        assert config["zero_optimization"]["stage"] == 2  # the rest of the generated config is unchanged


EXPLICIT = [
    # (arguments, explicit config section, the section handed to DeepSpeed)
    (
        {},
        {"partition_activations": True, "number_checkpoints": 4},
        {"partition_activations": True, "number_checkpoints": 4},
    ),  # the config wins
    ({"cpu_checkpointing": True}, None, {"cpu_checkpointing": True}),  # added where the config is silent
    (
        {"cpu_checkpointing": True},
        {"partition_activations": True},
        {"partition_activations": True, "cpu_checkpointing": True},
    ),
    (
        {"partition_activations": True},
        {"partition_activations": True},
        {"partition_activations": True},
    ),  # agreeing is fine
    (
        {"partition_activations": True, "contiguous_memory_optimization": True},
        {"number_checkpoints": 2},
        {"number_checkpoints": 2, "partition_activations": True, "contiguous_memory_optimization": True},
    ),
]


@pytest.mark.parametrize(("arguments", "given", "expected"), EXPLICIT)
def test_an_explicit_config_keeps_its_values_and_gains_the_arguments(arguments, given, expected):
    config = {"zero_optimization": {"stage": 1}}
    if given is not None:
        config["activation_checkpointing"] = dict(given)
    built = DeepSpeedStrategy(config=config, **arguments)._build_config(FIT)
    assert built["activation_checkpointing"] == expected and built["zero_optimization"] == {"stage": 1}
    assert config.get("activation_checkpointing") == given  # the caller's dict is not changed


REFUSED = [
    (
        {"partition_activations": True},
        {"activation_checkpointing": {"partition_activations": False}},
        ValueError,
        r"partition_activations=True\) conflicts with the config's"
        r" activation_checkpointing\['partition_activations'\]=False",
    ),
    (
        {"cpu_checkpointing": True},
        {"activation_checkpointing": [1]},
        ValueError,
        "activation_checkpointing=\\[1\\]; it must be a dict",
    ),
    (
        {"contiguous_memory_optimization": True},
        None,
        ValueError,
        "contiguous_memory_optimization=True needs partition_activations=True",
    ),
    (
        {"contiguous_memory_optimization": True, "partition_activations": True},
        None,
        ValueError,
        "needs the number of checkpointed layers.*number_checkpoints",
    ),
    (
        {},
        {"activation_checkpointing": {"contiguous_memory_optimization": True}},
        ValueError,
        "needs partition_activations=True",
    ),
    ({"partition_activations": "yes"}, None, TypeError, "partition_activations='yes' is not valid; pass True or False"),
    ({"synchronize_checkpoint_boundary": 1}, None, TypeError, "synchronize_checkpoint_boundary=1"),
]


@pytest.mark.parametrize(("arguments", "config", "error", "match"), REFUSED)
def test_conflicts_and_impossible_settings_are_refused_at_construction(arguments, config, error, match):
    with pytest.raises(error, match=match):
        DeepSpeedStrategy(config=config, **arguments)


class FakeCheckpointing:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def configure(self, mpu_: Any, **settings: Any) -> None:
        self.calls.append({"mpu_": mpu_, **settings})


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (None, None),
        (
            {"partition_activations": True, "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True},
            {
                "mpu_": None,
                "partition_activations": True,
                "contiguous_checkpointing": None,
                "num_checkpoints": None,
                "checkpoint_in_cpu": True,
                "synchronize": True,
                "profile": None,
            },
        ),
        (
            {
                "partition_activations": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 3,
                "profile": True,
            },
            {
                "mpu_": None,
                "partition_activations": True,
                "contiguous_checkpointing": True,
                "num_checkpoints": 3,
                "checkpoint_in_cpu": None,
                "synchronize": None,
                "profile": True,
            },
        ),
    ],
)
def test_deepspeed_checkpointing_is_configured_from_the_section(section, expected):
    deepspeed = SimpleNamespace(checkpointing=FakeCheckpointing())
    config = {} if section is None else {"activation_checkpointing": section}
    assert configure_activation_checkpointing(deepspeed, config) is (expected is not None)
    assert deepspeed.checkpointing.calls == ([] if expected is None else [expected])


def test_configure_is_called_when_the_training_engine_is_built(monkeypatch):
    deepspeed = SimpleNamespace(checkpointing=FakeCheckpointing())
    strategy = DeepSpeedStrategy(partition_activations=True)
    calls = []
    monkeypatch.setattr(deepspeed_module, "_import_deepspeed", lambda: deepspeed)
    monkeypatch.setattr(strategy, "_initialize_training_engine", lambda config, settings: calls.append("engine"))
    monkeypatch.setattr(strategy, "setup_precision_plugin", lambda: None)
    monkeypatch.setattr(strategy, "model_to_device", lambda: None)
    strategy.accelerator = SimpleNamespace(setup=lambda: None)
    strategy._module = phalanx.TrainingModule()
    strategy.setup(FIT)
    assert calls == ["engine"] and deepspeed.checkpointing.calls[0]["partition_activations"] is True
