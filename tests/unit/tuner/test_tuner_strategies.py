"""Which strategies the tuner runs on with several processes: DDP started by re-running the script tunes on every rank
through a twin of its strategy (same settings and devices); spawned or forked workers and sharded strategies are refused
by name, before any process starts or any work is done, by the Tuner and both callbacks. The runs themselves are in
tests/distributed/test_tuner_processes.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import BatchSizeFinder, LearningRateFinder
from phalanx.strategies import DDPStrategy
from phalanx.tuner import Tuner


class _Sized(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.1
        self.batch_size = 2
        self.net = nn.Linear(4, 1)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(16, 4)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise AssertionError("a refused tuner must train nothing")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


TOOLS = {
    "Tuner.lr_find": lambda trainer, model: Tuner(trainer).lr_find(model),
    "LearningRateFinder": lambda trainer, model: LearningRateFinder().lr_find(trainer, model),
    "Tuner.scale_batch_size": lambda trainer, model: Tuner(trainer).scale_batch_size(model),
    "BatchSizeFinder": lambda trainer, model: BatchSizeFinder().scale_batch_size(trainer, model),
}
REFUSED = [
    ("ddp_spawn", "DDPStrategy"),
    ("ddp_fork", "DDPStrategy"),
    ("ddp_notebook", "DDPStrategy"),
    ("fsdp", "FSDPStrategy"),
    ("model_parallel", "ModelParallelStrategy"),
    ("deepspeed", "DeepSpeedStrategy"),
]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize(("strategy", "name"), REFUSED)
def test_a_strategy_that_cannot_tune_on_several_processes_is_refused_by_name(strategy, name, tool):
    trainer = phalanx.Trainer(accelerator="cpu", strategy=strategy, devices=2, logger=False)
    model = _Sized()
    with pytest.raises(RuntimeError, match=f"does not run on {name} with 2 processes.*strategy='ddp'"):
        TOOLS[tool](trainer, model)
    assert trainer.strategy.launcher is None or not getattr(trainer.strategy.launcher, "procs", [])  # none started
    assert (model.lr, model.batch_size) == (0.1, 2)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, {"_timeout": timedelta(minutes=30), "_ddp_kwargs": {}, "_process_group_backend": None}),
        (
            {"timeout": timedelta(seconds=42), "find_unused_parameters": True, "process_group_backend": "gloo"},
            {"_timeout": timedelta(seconds=42), "_ddp_kwargs": {"find_unused_parameters": True}},
        ),
        ({"start_method": "spawn"}, None),
    ],
)
def test_ddp_tunes_through_a_new_strategy_with_its_settings_and_devices(options, expected):
    trainer = phalanx.Trainer(accelerator="cpu", strategy=DDPStrategy(**options), devices=2, logger=False)
    twin = trainer.strategy.twin_for_tuning()
    if expected is None:
        assert twin is None
        return
    assert isinstance(twin, DDPStrategy) and twin is not trainer.strategy
    assert twin.parallel_devices == trainer.strategy.parallel_devices == [torch.device("cpu")] * 2
    assert {key: getattr(twin, key) for key in expected} == expected
    assert twin.launcher is None and twin.module is None  # set up by the tuner's own Trainer, in these processes
