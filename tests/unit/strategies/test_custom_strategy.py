"""The Strategy contract: user strategies plug in, parts are composed, and wrapped models get forward redirection."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch import nn

from phalanx.accelerators import CPUAccelerator
from phalanx.plugins import DoublePrecision, Precision
from phalanx.strategies import RunSettings, SingleDeviceStrategy, Strategy
from phalanx.strategies.forward_redirection import redirect_forward


class CountingAccelerator(CPUAccelerator):
    def __init__(self) -> None:
        self.setup_devices: list[torch.device] = []
        self.torn_down = 0

    def setup_device(self, device: torch.device) -> None:
        self.setup_devices.append(device)

    def teardown(self) -> None:
        self.torn_down += 1


class CountingPrecision(Precision):
    def __init__(self) -> None:
        self.backward_calls = 0
        self.steps = 0

    def backward(self, tensor, module, optimizer, *args, **kwargs):
        self.backward_calls += 1
        super().backward(tensor, module, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        self.steps += 1
        return super().optimizer_step(optimizer, model, closure, **kwargs)


class MinimalStrategy(Strategy):
    """A strategy written from the abstract base only."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def model_to_device(self) -> None:
        self.module.to(self.root_device)

    @property
    def is_global_zero(self) -> bool:
        return True

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor

    def barrier(self, name=None) -> None:
        pass

    def broadcast(self, obj, src=0):
        return obj

    def all_gather(self, tensor, group=None, sync_grads=False):
        return tensor


class WrappingStrategy(SingleDeviceStrategy):
    """Wraps the module like DDP does, to check that steps go through the wrapper's forward."""

    def setup(self, settings: RunSettings) -> None:
        super().setup(settings)
        self.model = CallCounter(self.module)


class CallCounter(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("strategy_class", [MinimalStrategy, SingleDeviceStrategy])
def test_custom_strategy_instance_with_its_own_accelerator_and_precision(strategy_class):
    accelerator = CountingAccelerator()
    precision = CountingPrecision()
    strategy = strategy_class(accelerator=accelerator, precision_plugin=precision)
    trainer = quiet_trainer(strategy=strategy, max_steps=3)
    assert trainer.strategy is strategy
    assert strategy.accelerator is accelerator and strategy.precision_plugin is precision
    trainer.fit(Regressor(), loaders()[0])
    assert accelerator.setup_devices == [torch.device("cpu")]
    assert accelerator.torn_down == 1
    assert precision.backward_calls == 3 and precision.steps == 3


def test_strategy_instance_without_parts_gets_them_from_the_trainer():
    strategy = SingleDeviceStrategy(device="cpu")
    trainer = quiet_trainer(strategy=strategy, precision="64-true")
    assert isinstance(strategy.accelerator, CPUAccelerator)
    assert isinstance(strategy.precision_plugin, DoublePrecision)
    assert trainer.precision == "64-true"


def test_strategy_instance_conflicts_are_refused():
    with pytest.raises(ValueError, match="precision plugin"):
        quiet_trainer(strategy=SingleDeviceStrategy(precision_plugin=Precision()), precision="64-true")


def test_steps_are_redirected_through_the_wrapper():
    strategy = WrappingStrategy(device="cpu")
    trainer = quiet_trainer(strategy=strategy, max_steps=4)
    module = Regressor()
    trainer.fit(module, *loaders(n=32, batch_size=8))
    wrapper = strategy.model
    assert isinstance(wrapper, CallCounter)
    # 4 training steps + validation at epoch end (2 batches) + sanity check (2 batches)
    assert wrapper.calls == 4 + 2 + 2
    assert "forward" not in module.__dict__  # the original forward is back


def test_redirect_forward_restores_forward_even_on_error():
    module = Regressor()
    wrapper = CallCounter(module)

    def failing_step(*args: Any) -> None:
        raise RuntimeError("inside step")

    module.failing_step = failing_step
    with pytest.raises(RuntimeError, match="inside step"):
        redirect_forward(wrapper, module, "failing_step", 1)
    assert "forward" not in module.__dict__
    assert module(torch.ones(1, 4)).shape == (1, 1)


def test_tensor_init_context_applies_precision_and_empty_init():
    strategy = SingleDeviceStrategy(device="cpu", precision_plugin=DoublePrecision())
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with strategy.tensor_init_context(empty_init=True):
        layer = nn.Linear(8, 8)
    assert layer.weight.dtype == torch.float64
    assert torch.equal(torch.get_rng_state(), state)  # initialisers were skipped: no random numbers drawn
    with strategy.tensor_init_context(empty_init=False):
        nn.Linear(8, 8)
    assert not torch.equal(torch.get_rng_state(), state)
    assert torch.get_default_dtype() == torch.float32


def test_registered_strategy_name_lookup_is_case_insensitive():
    trainer = quiet_trainer(strategy="SINGLE_DEVICE")
    assert isinstance(trainer.strategy, SingleDeviceStrategy)


def test_base_strategy_contract_defaults():
    strategy = SingleDeviceStrategy()
    assert strategy.traits.restore_checkpoint_after_setup is False
    assert strategy.traits.restores_optimizer is False
    assert strategy.traits.handles_gradient_accumulation is False
    assert strategy.reduce_boolean_decision(True) is True
    assert strategy.all_gather_object({"a": 1}) == [{"a": 1}]
    assert strategy.distributed_sampler_kwargs is None
    with strategy.block_backward_sync():
        pass
