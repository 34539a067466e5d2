"""Every public name of Lightning's packages (the top level, callbacks, loggers, profilers, strategies, plugins,
accelerators, utilities, trainer, cli) is in phalanx's package of the same name or refused on import with an ImportError
naming what to use, which the migration guide lists too. The names are read from the installed pytorch_lightning (a name
Lightning adds fails here until it gets one or the other); where it is not installed, from the lists of Lightning 2.6's
names below."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PACKAGES = ("callbacks", "loggers", "profilers")  # those with a NOT_OFFERED table each, checked against Lightning's
#: Every package whose names are checked: "" is the top level.
ALL_PACKAGES = (
    *PACKAGES, "", "strategies", "plugins", "plugins.precision", "plugins.environments", "plugins.io", "accelerators",
    "utilities", "trainer", "cli",
)  # fmt: skip
GUIDE = (Path(__file__).parents[2] / "docs" / "migrating-from-lightning.md").read_text()
# The callbacks planned in issue 38, listed as "not offered yet" until then (all of them are offered now).
PLANNED: set[str] = set()


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
    "": ["Callback", "LightningDataModule", "LightningModule", "Trainer", "seed_everything"],
    "strategies": [
        "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy", "ParallelStrategy",
        "SingleDeviceStrategy", "Strategy",
    ],
    "plugins": [
        "AsyncCheckpointIO", "BitsandbytesPrecision", "CheckpointIO", "DeepSpeedPrecision", "DoublePrecision",
        "FSDPPrecision", "HalfPrecision", "LayerSync", "MixedPrecision", "Precision", "TorchCheckpointIO",
        "TorchSyncBatchNorm", "TransformerEnginePrecision", "XLACheckpointIO", "XLAPrecision",
    ],
    "plugins.precision": [
        "BitsandbytesPrecision", "DeepSpeedPrecision", "DoublePrecision", "FSDPPrecision", "HalfPrecision",
        "MixedPrecision", "Precision", "TransformerEnginePrecision", "XLAPrecision",
    ],
    "plugins.io": ["AsyncCheckpointIO", "CheckpointIO", "TorchCheckpointIO", "XLACheckpointIO"],
    "accelerators": [
        "Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator", "XLAAccelerator",
        "find_usable_cuda_devices",
    ],
    "utilities": [
        "AttributeDict", "CombinedLoader", "GradClipAlgorithmType", "LightningEnum", "disable_possible_user_warnings",
        "find_shared_parameters", "grad_norm", "is_picklable", "is_shared_filesystem", "measure_flops",
        "move_data_to_device", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn",
        "set_shared_parameters", "suggested_max_num_workers",
    ],
    "trainer": ["Trainer", "seed_everything"],
}  # fmt: skip
# Lightning's packages without an __all__: their public names, listed by hand.
UNLISTED = {
    "plugins.environments": [
        "ClusterEnvironment", "KubeflowEnvironment", "LSFEnvironment", "LightningEnvironment", "MPIEnvironment",
        "SLURMEnvironment", "TorchElasticEnvironment", "XLAEnvironment",
    ],
    "cli": [
        "ArgsType", "LRSchedulerCallable", "LRSchedulerType", "LRSchedulerTypeTuple", "LRSchedulerTypeUnion",
        "LightningArgumentParser", "LightningCLI", "OptimizerCallable", "ReduceLROnPlateau", "SaveConfigCallback",
        "instantiate_class", "instantiate_module",
    ],
}  # fmt: skip


def _lightning_all(package: str) -> list[str]:
    if package in UNLISTED:
        return UNLISTED[package]
    try:
        return sorted(importlib.import_module("pytorch_lightning" + (f".{package}" if package else "")).__all__)
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


def _phalanx(package: str) -> str:
    return "phalanx" + (f".{package}" if package else "")


@pytest.mark.parametrize(
    ("package", "name"),
    [(package, name) for package in ALL_PACKAGES if package not in PACKAGES for name in _lightning_all(package)],
    ids=lambda value: value or "phalanx",
)
def test_every_other_lightning_import_works_or_says_what_to_use(package, name):
    namespace: dict = {}
    try:
        exec(f"from {_phalanx(package)} import {name}", namespace)
    except ImportError as error:
        assert f"Lightning's {name} is not offered in {_phalanx(package)}; use " in str(error), str(error)
        assert f"`{name}`" in GUIDE, f"docs/migrating-from-lightning.md does not list {name}"
        return
    assert namespace[name] is not None


@pytest.mark.parametrize("package", ALL_PACKAGES)
def test_other_missing_names_stay_attribute_errors(package):
    module = importlib.import_module(_phalanx(package))
    assert not hasattr(module, "NoSuchThing")
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing'"):
        exec(f"from {_phalanx(package)} import NoSuchThing", {})


def test_the_planned_callbacks_are_listed_as_not_offered_yet():
    table = _table("callbacks")
    assert {name for name, entry in table.items() if entry.planned} == PLANNED


@pytest.mark.parametrize("package", PACKAGES)
def test_the_tables_hold_only_lightning_names_phalanx_lacks(package):
    lightning = set(_lightning_all(package))
    ours = set(importlib.import_module(f"phalanx.{package}").__all__)
    table = set(_table(package))
    assert not table & ours
    extra = table - lightning
    assert extra <= {"NeptuneLogger"}, extra  # Lightning's module has it, outside __all__
