"""``Strategy.allows_inference_mode``: evaluation runs under inference mode only where the strategy's module keeps no
tensor made there that training later updates in place (FSDP2's gathered parameters, ZeRO-3's, XLA's tensors)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy, StrategyTraits

#: Every strategy phalanx registers, and whether it lets evaluation run under inference mode.
ALLOWS = {
    **{name: True for name in STRATEGY_REGISTRY.available() if name.startswith("ddp") or name == "single_device"},
    **{name: not name.startswith("deepspeed_stage_3") for name in STRATEGY_REGISTRY.available() if "deepspeed" in name},
    **{name: False for name in ("fsdp", "fsdp_cpu_offload", "hsdp_ft", "model_parallel")},
    **{name: False for name in ("single_xla", "xla", "xla_debug", "xla_fsdp", "xla_spmd", "xla_spmd_dp")},
}
#: Registered by the integrations under tests/ (not phalanx's own).
INTEGRATIONS = {"hivemind", "example_single_device"}


def test_every_registered_strategy_is_in_the_table() -> None:
    assert set(STRATEGY_REGISTRY.available()) - INTEGRATIONS == set(ALLOWS)


@pytest.mark.parametrize(("name", "allows"), sorted(ALLOWS.items()))
def test_which_strategies_allow_inference_mode(name: str, allows: bool) -> None:
    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    assert STRATEGY_REGISTRY.get(name).traits.allows_inference_mode is allows


class KeepsGathered(Regressor):
    """Keeps a tensor it makes in its first forward pass and updates it in place in every later one, as FSDP2 does
    with the buffers it gathers parameters into; ``modes`` records (inference mode, grad mode) in each step."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: torch.Tensor | None = None
        self.modes: list[tuple[str, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.net[0].weight
        if self.gathered is None:
            self.gathered = torch.empty_like(weight)
        self.gathered.copy_(weight.detach())
        return super().forward(x)

    def _record(self, stage: str) -> None:
        self.modes.append((stage, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("validation")
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("test")
        return self(batch[0]).sum()

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self._record("predict")
        return self(batch[0])

    def on_validation_batch_end(self, *args: Any) -> None:
        self._record("hook")


class KeepsGatheredStrategy(SingleDeviceStrategy):
    """A user's strategy whose module keeps such tensors: it says so."""

    def declare_traits(self) -> StrategyTraits:
        return dataclasses.replace(super().declare_traits(), allows_inference_mode=False)


def _evaluate_then_fit(first: str, strategy: Any) -> KeepsGathered:
    train, val = loaders(n=32)
    model = KeepsGathered()
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    if first == "validate":
        trainer.validate(model, val, verbose=False)
    elif first == "test":
        trainer.test(model, val, verbose=False)
    elif first == "predict":
        trainer.predict(model, val)
    trainer.fit(model, train, val)  # with its sanity check
    return model


FIRST_STAGES = ["sanity check", "validate", "test", "predict"]


@pytest.mark.parametrize("first", FIRST_STAGES)
def test_evaluation_runs_under_no_grad_where_the_strategy_does_not_allow_inference_mode(first: str) -> None:
    model = _evaluate_then_fit(first, KeepsGatheredStrategy(device="cpu"))
    assert model.modes and all(not inference and not grad for _, inference, grad in model.modes), model.modes


@pytest.mark.parametrize("first", FIRST_STAGES)
def test_inference_mode_would_break_training_of_such_a_module(first: str) -> None:
    # What the property prevents (the FSDP failure of issue 23): the same run where inference mode is allowed.
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        _evaluate_then_fit(first, "single_device")


@pytest.mark.parametrize("step", ["validation_step", "test_step", "predict_step"])
@pytest.mark.parametrize(("strategy_type", "inference"), [(SingleDeviceStrategy, True), (KeepsGatheredStrategy, False)])
def test_a_direct_caller_in_inference_mode_gets_no_grad_where_not_allowed(
    step: str, strategy_type: type, inference: bool
) -> None:
    # A Cohort loop calls the strategy's steps itself, possibly under torch.inference_mode().
    model = KeepsGathered()
    strategy = strategy_type(device="cpu")
    strategy.connect(model)
    batch = (torch.randn(2, 4), torch.randn(2, 1))
    with torch.inference_mode():
        getattr(strategy, step)(batch, 0)
    assert model.modes[-1][1:] == (inference, False)
