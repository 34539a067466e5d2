"""Every public name of Lightning's callbacks, loggers and profilers is in phalanx's package of the same kind or in its
table of names not offered: importing one of those raises an ImportError naming what to use, and the migration
guide lists it. The names are read from the installed pytorch_lightning (a name Lightning adds fails here until it
gets one or the other); where it is not installed, from the list of Lightning 2.6's names below."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PACKAGES = ("callbacks", "loggers", "profilers")
GUIDE = (Path(__file__).parents[2] / "docs" / "migrating-from-lightning.md").read_text()
# The callbacks planned in issue 38, listed as "not offered yet" until then.
PLANNED = {
    "ModelPruning", "Timer", "LambdaCallback", "OnExceptionCheckpoint", "RichProgressBar", "RichModelSummary",
    "BasePredictionWriter", "LearningRateFinder", "BatchSizeFinder",
}  # fmt: skip


# The __all__ of pytorch_lightning 2.6's three packages, for machines without it.
LIGHTNING_2_6 = {
    "callbacks": [
        "BackboneFinetuning", "BaseFinetuning", "BasePredictionWriter", "BatchSizeFinder", "Callback", "Checkpoint",
        "DeviceStatsMonitor", "EMAWeightAveraging", "EarlyStopping", "GradientAccumulationScheduler", "LambdaCallback",
        "LearningRateFinder", "LearningRateMonitor", "ModelCheckpoint", "ModelPruning", "ModelSummary",
        "OnExceptionCheckpoint", "ProgressBar", "RichModelSummary", "RichProgressBar", "SpikeDetection",
        "StochasticWeightAveraging", "TQDMProgressBar", "ThroughputMonitor", "Timer", "WeightAveraging",
    ],
    "loggers": ["CSVLogger", "CometLogger", "LitLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"],
    "profilers": [
        "AdvancedProfiler", "PassThroughProfiler", "Profiler", "PyTorchProfiler", "SimpleProfiler", "XLAProfiler"
    ],
}  # fmt: skip


def _lightning_all(package: str) -> list[str]:
    try:
        return sorted(importlib.import_module(f"pytorch_lightning.{package}").__all__)
    except ImportError:
        return LIGHTNING_2_6[package]


def _lightning_names() -> list[tuple[str, str]]:
    return [(package, name) for package in PACKAGES for name in _lightning_all(package)]


def _table(package: str) -> dict:
    return importlib.import_module(f"phalanx.{package}").NOT_OFFERED


@pytest.mark.parametrize(("package", "name"), _lightning_names(), ids=lambda value: value)
def test_every_lightning_name_is_offered_or_says_what_to_use(package, name):
    ours = importlib.import_module(f"phalanx.{package}")
    if name in ours.__all__:
        assert name not in _table(package)
        return
    assert name in _table(package), f"Lightning's {package}.{name} is neither in phalanx.{package} nor in its table"
    with pytest.raises(ImportError, match=f"Lightning's {name} is not offered") as raised:
        exec(f"from phalanx.{package} import {name}", {})
    assert _table(package)[name].instead in str(raised.value)
    assert f"`{name}`" in GUIDE, f"docs/migrating-from-lightning.md does not list {name}"


@pytest.mark.parametrize("package", PACKAGES)
def test_other_missing_names_stay_attribute_errors(package):
    module = importlib.import_module(f"phalanx.{package}")
    assert not hasattr(module, "NoSuchThing")
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing'"):
        exec(f"from phalanx.{package} import NoSuchThing", {})


def test_the_planned_callbacks_are_listed_as_not_offered_yet():
    table = _table("callbacks")
    assert {name for name, entry in table.items() if entry.planned} == PLANNED
    with pytest.raises(ImportError, match="OnExceptionCheckpoint is not offered yet .* use ModelCheckpoint"):
        from phalanx.callbacks import OnExceptionCheckpoint  # noqa: F401


@pytest.mark.parametrize("package", PACKAGES)
def test_the_tables_hold_only_lightning_names_phalanx_lacks(package):
    lightning = set(_lightning_all(package))
    ours = set(importlib.import_module(f"phalanx.{package}").__all__)
    table = set(_table(package))
    assert not table & ours
    extra = table - lightning
    assert extra <= {"NeptuneLogger"}, extra  # Lightning's module has it, outside __all__
