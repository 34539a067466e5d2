"""The compile unit each strategy declares, the user's choice through ``compile={"unit": ...}`` on the Trainer and the
Cohort, and the set-up log line that says which unit was compiled and why."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import STRATEGY_REGISTRY, RunSettings


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum(1, keepdim=True)


class Net(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.trunk(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


#: The measured choices (docs/compile.md): the whole model unless block boundaries carry the sharding hooks.
BLOCKS = {"fsdp", "fsdp_cpu_offload", "hsdp_ft", "model_parallel"}


@pytest.mark.parametrize("name", sorted(STRATEGY_REGISTRY.available()))
def test_each_strategy_declares_its_unit(name: str) -> None:
    cls: Any = STRATEGY_REGISTRY.get_class(name)
    assert cls.default_compile_unit == ("blocks" if name in BLOCKS else "model")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _data() -> DataLoader:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _compiled(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if module._compiled_call_impl is not None]


@pytest.mark.parametrize(
    ("compile_", "compiled", "log"),
    [
        ({"backend": "eager"}, ["trunk"], "unit 'model' (SingleDeviceStrategy's default): compiling trunk (Trunk)"),
        (
            {"backend": "eager", "unit": "blocks"},
            ["trunk.blocks.0", "trunk.blocks.1", "trunk.blocks.2"],
            "unit 'blocks' (compile={'unit': ...}): compiling 3 blocks (trunk.blocks.0 ... trunk.blocks.2)",
        ),
        (
            {"backend": "eager", "unit": "model"},
            ["trunk"],
            "unit 'model' (compile={'unit': ...}): compiling trunk (Trunk)",
        ),
    ],
)
def test_the_trainer_compiles_the_unit_asked_for_and_says_so(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, compile_: dict, compiled: list[str], log: str
) -> None:
    model = Net()
    trainer = phalanx.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), compile=compile_,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="phalanx"):
        trainer.fit(model, _data())
    assert _compiled(model) == compiled
    lines = [record.getMessage() for record in caplog.records if "torch.compile:" in record.getMessage()]
    assert lines == [f"torch.compile: {log} in place."]


@pytest.mark.parametrize(("unit", "compiled"), [(None, ["trunk"]), ("blocks", ["trunk.blocks.0", "trunk.blocks.1"])])
def test_the_cohort_compiles_the_unit_asked_for(unit: str | None, compiled: list[str]) -> None:
    trunk = Trunk()
    trunk.blocks = trunk.blocks[:2]  # type: ignore[assignment]
    module = nn.Sequential()
    module.add_module("trunk", trunk)
    options = {"backend": "eager", **({"unit": unit} if unit else {})}
    cohort = phalanx.Cohort(accelerator="cpu", devices=1, compile=options)
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model(torch.randn(2, 8)).sum().backward()
    assert _compiled(module) == compiled


@pytest.mark.parametrize("unit", ["block", "everything", 3])
def test_run_settings_refuse_an_unknown_unit(unit: Any) -> None:
    with pytest.raises(ValueError, match=r"RunSettings\(compile_unit=.*\) is not valid; choose one of \['model', "):
        RunSettings(compile_unit=unit)
