"""The Trainer's side of the strategy contract: the RunSettings it passes, the checks it makes for a strategy, the
clear error for strategies written against the old Trainer-taking signatures."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import phalanx
from phalanx.accelerators import CPUAccelerator
from phalanx.strategies import RunSettings, SingleDeviceStrategy, StrategyTraits
from phalanx.trainer.loops.data import DataSource
from phalanx.trainer.run_settings import train_batch_size


class RecordingStrategy(SingleDeviceStrategy):
    """Keeps every RunSettings it is set up with; optionally asks for the training batch size."""

    def __init__(self, needs_batch_size: bool = False, **kwargs: Any) -> None:
        super().__init__(device="cpu", **kwargs)
        self.settings: list[RunSettings] = []
        self._needs_batch_size = needs_batch_size

    def declare_traits(self) -> StrategyTraits:
        return dataclasses.replace(super().declare_traits(), needs_train_batch_size=self._needs_batch_size)

    def setup(self, settings: RunSettings) -> None:
        self.settings.append(settings)
        super().setup(settings)


class CountingRegressor(Regressor):
    """Makes its own training data, counting how often it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.train_dataloader_calls = 0

    def train_dataloader(self) -> DataLoader:
        self.train_dataloader_calls += 1
        return loaders(batch_size=4)[0]


@pytest.mark.parametrize("method", ["fit", "validate", "test", "predict"])
def test_each_entry_point_sets_the_strategy_up_with_its_run_settings(method: str) -> None:
    strategy = RecordingStrategy()
    trainer = quiet_trainer(
        strategy=strategy,
        max_steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
    )
    train, val = loaders()
    getattr(trainer, method)(Regressor(), train if method == "fit" else val)
    (settings,) = strategy.settings
    assert settings.stage == method and settings.fitting is (method == "fit")
    assert (settings.accumulate_grad_batches, settings.gradient_clip_val, settings.gradient_clip_algorithm) == (
        2,
        0.5,
        "value",
    )
    assert (settings.configure_optimizers is not None) is (method == "fit")
    assert settings.before_optimizer_step == trainer._before_optimizer_step
    assert settings.train_batch_size is None  # the strategy did not ask for it
    assert strategy.run_settings is settings


@pytest.mark.parametrize(("needs", "expected_size", "expected_calls"), [(False, None, 1), (True, 4, 2)])
def test_the_training_batch_size_is_read_only_for_a_strategy_that_needs_it(
    needs: bool, expected_size: int | None, expected_calls: int
) -> None:
    strategy = RecordingStrategy(needs_batch_size=needs)
    module = CountingRegressor()
    quiet_trainer(strategy=strategy, max_steps=1, limit_val_batches=0).fit(module)
    assert strategy.settings[0].train_batch_size == expected_size
    assert module.train_dataloader_calls == expected_calls  # building the loader for its size is the only extra call


class _Sized(torch.utils.data.Sampler):
    def __iter__(self):
        yield [0, 1]

    def __len__(self) -> int:
        return 1


DATA = TensorDataset(torch.zeros(12, 2))
BATCH_SIZES = [
    ({"train": DataLoader(DATA, batch_size=5)}, 5),
    (
        {"train": DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), batch_size=3, drop_last=False))},
        3,
    ),
    ({"train": DataLoader(DATA, batch_sampler=_Sized())}, None),  # a batch sampler without batch_size: unknown
    ({"train": [DataLoader(DATA, batch_size=2), DataLoader(DATA, batch_size=6)]}, 2),  # the first loader's
    ({}, None),
]


@pytest.mark.parametrize(("dataloaders", "expected"), BATCH_SIZES)
def test_train_batch_size_comes_from_the_first_training_loader(
    dataloaders: dict[str, Any], expected: int | None
) -> None:
    assert train_batch_size(DataSource(phalanx.TrainingModule(), None, **dataloaders)) == expected


class EqualBatchesStrategy(SingleDeviceStrategy):
    """Pretends to be one of two processes that must run equally many evaluation batches; the other runs 3."""

    def declare_traits(self) -> StrategyTraits:
        return dataclasses.replace(super().declare_traits(), requires_equal_batches=True)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, [3.0]]


@pytest.mark.parametrize(
    ("method", "limit", "fails"),
    [("validate", 3, False), ("validate", 2, True), ("test", 2, True), ("predict", 2, True)],
)
def test_the_trainer_checks_equal_batch_counts_for_a_strategy_that_requires_them(
    method: str, limit: int, fails: bool
) -> None:
    trainer = quiet_trainer(
        strategy=EqualBatchesStrategy(device="cpu"),
        **{f"limit_{'val' if method == 'validate' else method}_batches": limit},
    )
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    stage = "validation" if method == "validate" else method
    if not fails:
        getattr(trainer, method)(Regressor(), data)
        return
    with pytest.raises(
        ValueError, match=rf"same number of {stage} batches; they differ \(rank 0: \[{limit}\], rank 1: \[3\]\)"
    ):
        getattr(trainer, method)(Regressor(), data)


class OldSetup(SingleDeviceStrategy):
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)


class OldSetupOptimizers(SingleDeviceStrategy):
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)


class OldAccelerator(CPUAccelerator):
    def setup(self, trainer: Any) -> None:
        pass


OLD_CONTRACT = [
    (
        lambda: OldSetup(device="cpu"),
        r"OldSetup.setup takes a `trainer` argument.*OldSetup.setup\(self, settings: RunSettings\) -> None instead",
    ),
    (
        lambda: OldSetupOptimizers(device="cpu"),
        r"OldSetupOptimizers.setup_optimizers\(self, settings: RunSettings\) -> None instead",
    ),
    (
        lambda: SingleDeviceStrategy(device="cpu", accelerator=OldAccelerator()),
        r"OldAccelerator.setup takes a `trainer` argument.*setup\(self\) -> None instead",
    ),
]


@pytest.mark.parametrize(("make_strategy", "message"), OLD_CONTRACT)
def test_a_strategy_written_for_the_old_contract_is_refused_at_construction(make_strategy: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        phalanx.Trainer(strategy=make_strategy(), accelerator="auto", logger=False)


def test_an_accelerator_written_for_the_old_contract_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"OldAccelerator.setup takes a `trainer` argument"):
        phalanx.Trainer(accelerator=OldAccelerator(), logger=False)


LIFECYCLE = (
    "connect",
    "setup_environment",
    "setup",
    "teardown",
    "on_train_start",
    "on_train_end",
    "on_train_batch_start",
    "training_step",
    "backward",
    "optimizer_step",
    "on_validation_start",
    "on_validation_end",
    "validation_step",
    "block_backward_sync",
    "batch_to_device",
)


class LifecycleStrategy(SingleDeviceStrategy):
    """Records every contract method the Trainer calls, in order."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.calls: list[str] = []


def _recording(name: str) -> Any:
    def method(self: LifecycleStrategy, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(name)
        return getattr(super(LifecycleStrategy, self), name)(*args, **kwargs)

    return method


for _name in LIFECYCLE:
    setattr(LifecycleStrategy, _name, _recording(_name))


def _fit_calls(accumulate: int) -> list[str]:
    strategy = LifecycleStrategy()
    trainer = quiet_trainer(
        strategy=strategy,
        max_steps=2,
        accumulate_grad_batches=accumulate,
        limit_val_batches=1,
        val_check_interval=2 * accumulate,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regressor(), *loaders(n=64, batch_size=8))
    return strategy.calls


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_trainer_calls_the_strategy_contract_in_order(accumulate: int) -> None:
    move = ["batch_to_device", "on_train_batch_start"]
    step = [*move, "optimizer_step", "training_step", "backward"]  # the closure runs inside optimizer_step
    window = [*move, "block_backward_sync", "training_step", "backward"] * (accumulate - 1)
    validation = ["on_validation_start", "batch_to_device", "validation_step", "on_validation_end"]
    assert _fit_calls(accumulate) == [
        "connect",
        "setup_environment",
        "setup",
        "on_train_start",
        *window,
        *step,
        *window,
        *step,
        *validation,
        "on_train_end",
        "teardown",
    ]
