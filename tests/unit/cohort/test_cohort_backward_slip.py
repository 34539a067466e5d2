"""``loss.backward()`` instead of ``cohort.backward(loss)``: refused where it trains differently (a GradScaler, a
precision plugin with its own backward, DeepSpeed), allowed and equal where it is the same computation. The
multi-process strategies run in tests/distributed/test_cohort_backward_slip_processes.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import phalanx
from phalanx.cohort.backward_guard import slip_reason
from phalanx.plugins.precision import MixedPrecision, Precision


class _OwnBackward(Precision):
    """A precision plugin of the user's that does something in backward."""

    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        return tensor


class _Net(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch).square().mean()


def _plugins(name: str) -> Any:
    return {
        "32-true": None,
        "bf16-mixed": MixedPrecision("bf16-mixed", device="cpu"),
        "16-mixed with a GradScaler": MixedPrecision(
            "16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)
        ),
        "a plugin with its own backward": _OwnBackward(),
    }[name]


def _cohort(precision: str) -> phalanx.Cohort:
    if precision == "16-mixed":  # on CPU without a GradScaler (phalanx makes one for CUDA only)
        return phalanx.Cohort(accelerator="cpu", strategy="single_device", precision="16-mixed")
    return phalanx.Cohort(accelerator="cpu", strategy="single_device", plugins=_plugins(precision))


def _weights_after_steps(precision: str, plain_backward: bool, via_training_step: bool = False) -> list[Tensor]:
    cohort = _cohort(precision)
    torch.manual_seed(0)
    module = _Net()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for step in range(3):
        x = torch.full((2, 4), float(step + 1))
        loss = model.training_step(x, step) if via_training_step else model(x).square().mean()
        if plain_backward:
            loss.backward()
        else:
            cohort.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize(
    ("precision", "refused"),
    [
        ("32-true", False),
        ("bf16-mixed", False),
        ("16-mixed", False),
        ("16-mixed with a GradScaler", True),
        ("a plugin with its own backward", True),
    ],
)
@pytest.mark.parametrize("via_training_step", [False, True], ids=["forward", "training_step"])
def test_loss_backward_is_refused_where_it_would_train_differently(precision, refused, via_training_step):
    if not refused:
        expected = _weights_after_steps(precision, plain_backward=False, via_training_step=via_training_step)
        got = _weights_after_steps(precision, plain_backward=True, via_training_step=via_training_step)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))  # harmless there: the same computation
        return
    with pytest.raises(RuntimeError, match=r"Call cohort\.backward\(loss\) instead of loss\.backward\(\)"):
        _weights_after_steps(precision, plain_backward=True, via_training_step=via_training_step)


def test_a_refused_backward_leaves_no_gradient_and_cohort_backward_goes_on():
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", plugins=_plugins("16-mixed with a GradScaler"))
    module = _Net()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loss = model(torch.ones(2, 4)).square().mean()
    with pytest.raises(RuntimeError, match="scales the loss with a GradScaler"):
        loss.backward(retain_graph=True)
    assert all(p.grad is None for p in module.parameters())
    cohort.backward(loss)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in module.parameters())
    optimizer.step()


def _strategy(name: str) -> Any:
    from phalanx.plugins.precision.fsdp import FSDPPrecision
    from phalanx.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    cpu = torch.device("cpu")
    scaled = FSDPPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    if name == "deepspeed_stage_2":
        pytest.importorskip("deepspeed")
        from phalanx.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=2)
    return {
        "single_device": lambda: SingleDeviceStrategy(device=cpu),
        "ddp": lambda: DDPStrategy(),
        "fsdp": lambda: FSDPStrategy(),
        "fsdp 16-mixed with a GradScaler": lambda: FSDPStrategy(precision_plugin=scaled),
    }[name]()


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [
        ("single_device", None),
        ("ddp", None),
        ("fsdp", None),
        ("fsdp 16-mixed with a GradScaler", "scales the loss with a GradScaler"),
        ("deepspeed_stage_2", "DeepSpeedStrategy runs backward through its own engine"),
    ],
)
def test_the_strategies_where_the_slip_matters_are_the_guarded_ones(strategy, reason):
    found = slip_reason(_strategy(strategy))
    assert found is None if reason is None else reason in found
