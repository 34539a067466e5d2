"""Multi-process strategies are refused up front on Apple's MPS accelerator (one device, no collective backend),
naming the strategy and what to use instead; tested without an MPS device by making MPS look available."""

from __future__ import annotations

import pytest

import phalanx
from phalanx.accelerators.mps import MPSAccelerator
from phalanx.strategies import DDPStrategy, FSDPStrategy
from phalanx.strategies.resolve import resolve_strategy
from phalanx.strategies.single_device import SingleDeviceStrategy

PARALLEL = [
    "ddp",
    "ddp_spawn",
    "ddp_fork",
    "ddp_notebook",
    "ddp_find_unused_parameters_true",
    "fsdp",
    "deepspeed",
    "deepspeed_stage_3",
    "model_parallel",
]


@pytest.fixture
def mps_available(monkeypatch):
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))


@pytest.mark.parametrize("accelerator", ["mps", "gpu", "auto", MPSAccelerator()])
@pytest.mark.parametrize("strategy", PARALLEL)
def test_parallel_strategy_names_are_refused_on_mps(mps_available, strategy, accelerator):
    with pytest.raises(
        ValueError, match=rf"strategy='{strategy}' runs several processes .* MPS accelerator .* accelerator='cpu'"
    ):
        resolve_strategy(accelerator=accelerator, strategy=strategy)


@pytest.mark.parametrize("make", [DDPStrategy, FSDPStrategy], ids=["DDPStrategy", "FSDPStrategy"])
def test_parallel_strategy_instances_are_refused_on_mps(mps_available, make):
    with pytest.raises(ValueError, match=rf"strategy=a {make.__name__} instance runs several processes .* MPS"):
        phalanx.Trainer(accelerator="mps", strategy=make(), logger=False)


@pytest.mark.parametrize("strategy", ["auto", "single_device"])
def test_one_process_on_mps_is_still_accepted(mps_available, strategy):
    built = resolve_strategy(accelerator="mps", strategy=strategy)
    assert isinstance(built, SingleDeviceStrategy) and built.root_device.type == "mps"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_same_strategies_run_on_the_cpu_while_mps_is_available(mps_available, strategy):
    assert resolve_strategy(accelerator="cpu", strategy=strategy, devices=2).accelerator.name == "cpu"
