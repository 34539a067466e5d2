"""DeepSpeedPrecision without an engine: dtypes, config sections, and what it asks of the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.plugins.precision import DeepSpeedPrecision


class FakeEngine(nn.Module):
    """Records what the plugin asks of a DeepSpeed engine (backward, step)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[str] = []

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")
        loss.backward()

    def step(self) -> None:
        self.calls.append("step")


def test_precision_names_dtypes_and_config_sections():
    assert DeepSpeedPrecision().precision == "32-true" and DeepSpeedPrecision().deepspeed_config() == {}
    assert DeepSpeedPrecision("16-mixed").dtype is torch.float16 and DeepSpeedPrecision(
        "16-true"
    ).deepspeed_config() == {"fp16": {"enabled": True}}
    assert DeepSpeedPrecision("bf16-mixed").deepspeed_config() == {"bf16": {"enabled": True}}
    with pytest.raises(
        ValueError,
        match=r"supports \['32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'\], got precision='64-true'",
    ):
        DeepSpeedPrecision("64-true")


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_module_and_inputs_take_the_half_dtype_without_autocast(precision):
    plugin = DeepSpeedPrecision(precision)
    module = plugin.convert_module(nn.Linear(2, 2))
    assert module.weight.dtype is torch.bfloat16
    batch = plugin.convert_input({"x": torch.ones(2), "index": torch.arange(2)})
    assert batch["x"].dtype is torch.bfloat16 and batch["index"].dtype is torch.int64
    with plugin.forward_context():
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.ones(1).dtype is torch.bfloat16) == precision.endswith("-true")
    with plugin.tensor_init_context():
        assert (torch.get_default_dtype() is torch.bfloat16) == precision.endswith("-true")
    assert torch.get_default_dtype() is torch.float32


def test_zero3_partitioned_modules_and_float32_are_left_alone():
    module = nn.Linear(2, 2)
    assert DeepSpeedPrecision().convert_module(module).weight.dtype is torch.float32
    assert torch.equal(DeepSpeedPrecision().convert_input(torch.ones(2)), torch.ones(2))
    module.weight.ds_id = (
        0  # a ZeRO-3 parameter: casting .data would miss its shards; DeepSpeed created them in the right dtype
    )
    assert DeepSpeedPrecision("bf16-mixed").convert_module(module).weight.dtype is torch.float32


def test_backward_and_step_go_through_the_engine():
    plugin = DeepSpeedPrecision()
    module = nn.Linear(2, 1)
    module.automatic_optimization = True
    engine = FakeEngine(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def closure():
        loss = module(torch.ones(1, 2)).sum()
        plugin.backward(loss, engine, optimizer)
        return loss

    assert plugin.optimizer_step(optimizer, engine, closure) is not None
    assert engine.calls == ["backward", "step"]
    assert module.weight.grad is not None
    with pytest.raises(RuntimeError, match="DeepSpeed cannot skip a step"):
        plugin.optimizer_step(optimizer, engine, lambda: None)
    with pytest.raises(RuntimeError, match="needs the DeepSpeed engine"):
        plugin.backward(torch.ones(()), module, optimizer)
    with pytest.raises(RuntimeError, match="needs the DeepSpeed engine"):
        plugin.optimizer_step(optimizer, module, closure)


def test_the_before_step_callback_runs_before_the_engine_steps():
    plugin = DeepSpeedPrecision()
    module = nn.Linear(2, 1)
    module.automatic_optimization = True
    engine = FakeEngine(module)
    seen = []
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    plugin.optimizer_step(
        optimizer, engine, lambda: torch.ones(()), before_step=lambda opt: seen.append((opt, list(engine.calls)))
    )
    assert seen == [(optimizer, [])] and engine.calls == ["step"]


def test_clipping_is_the_engines_and_other_requests_are_refused():
    plugin = DeepSpeedPrecision()
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    assert plugin.clip_gradients(optimizer, 0.0) is None  # nothing asked
    plugin.engine_gradient_clipping = 0.5
    assert plugin.clip_gradients(optimizer, 0.5, "norm") is None  # the engine clips inside step()
    with pytest.raises(ValueError, match="clips gradients by norm only"):
        plugin.clip_gradients(optimizer, 0.5, "value")
    with pytest.raises(
        ValueError, match=r"with the config's 'gradient_clipping' \(0.5\); clipping to 2.0 here cannot work"
    ):
        plugin.clip_gradients(optimizer, 2.0)
    with pytest.raises(ValueError, match="choose 'norm' or 'value'"):
        plugin.clip_gradients(optimizer, 0.5, "l2")
