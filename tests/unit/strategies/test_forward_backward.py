"""Strategy.forward_backward: the one step through which the Trainer turns a batch into a loss and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer
from torch import nn

import phalanx
from phalanx.strategies import SingleDeviceStrategy


class RecordingStrategy(SingleDeviceStrategy):
    """The base class's forward_backward, with what went in and came out of ``between`` recorded."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.calls: list[tuple[float | None, float | None]] = []

    def forward_backward(self, batch, batch_idx, between, optimizer):
        def recording(output: Any) -> torch.Tensor | None:
            loss = between(output)
            raw = output["loss"] if isinstance(output, dict) else output
            self.calls.append((None if raw is None else raw.item(), None if loss is None else loss.item()))
            return loss

        return super().forward_backward(batch, batch_idx, recording, optimizer)


class Returning(Regressor):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.form == "none_on_odd" and batch_idx % 2:
            return None
        return {"loss": loss} if self.form == "dict" else loss


@pytest.mark.parametrize(
    ("form", "accumulate", "stepped"),
    [("tensor", 1, 8), ("dict", 1, 8), ("tensor", 2, 4), ("dict", 4, 2), ("none_on_odd", 1, 8)],
)
def test_the_trainer_runs_every_batch_through_forward_backward(form, accumulate, stepped):
    strategy = RecordingStrategy()
    module = Returning(form)
    train, _ = loaders(n=64, batch_size=8, shuffle=False)
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, accumulate_grad_batches=accumulate)
    trainer.fit(module, train)
    assert len(strategy.calls) == 8 and trainer.global_step == stepped
    for raw, backpropagated in strategy.calls:
        if raw is None:
            assert backpropagated is None  # a skipped batch: nothing reaches backward
        else:
            assert backpropagated == pytest.approx(raw / accumulate)


class ScheduleLikeStrategy(SingleDeviceStrategy):
    """Runs both halves itself, as a pipeline schedule does: its own forward and loss, then backward on the result."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.steps = 0

    def forward_backward(self, batch, batch_idx, between, optimizer):
        self.steps += 1
        x, y = batch
        output = nn.functional.mse_loss(self.module(x), y)
        loss = between(output)
        if loss is not None:
            loss.backward()
        return loss, output


def test_a_strategy_that_owns_both_halves_trains_like_the_default_step(tmp_path):
    # Defaults on (validation with sanity check, CSV logger, checkpoints, progress bar) for the strategy's own step.
    train, val = loaders(n=32, batch_size=8, shuffle=False)
    phalanx.seed_everything(1)
    default = Regressor()
    quiet_trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(default, train, val)
    phalanx.seed_everything(1)
    owned, strategy = Regressor(), ScheduleLikeStrategy()
    trainer = phalanx.Trainer(
        strategy=strategy, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, default_root_dir=tmp_path
    )
    trainer.fit(owned, train, val)
    assert strategy.steps == 8 and trainer.global_step == 4
    for a, b in zip(parameters_of(default), parameters_of(owned)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert trainer.callback_metrics["val_loss"].isfinite()


# The step's pass-through layers (issue 37): the base strategy and precision skip the ones a subclass left alone, and
# call every one a subclass overrides. (owner, method) -> the step that must call it.
PASS_THROUGHS = [
    ("strategy", "_run_step"),
    ("strategy", "pre_backward"),
    ("strategy", "post_backward"),
    ("strategy", "_before_optimizer_step"),
    ("precision", "train_step_context"),
    ("precision", "forward_context"),
    ("precision", "pre_backward"),
    ("precision", "post_backward"),
    ("precision", "_after_closure"),
]


def _counting(base: type, name: str, calls: list[str]) -> type:
    def counted(self, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return getattr(base, name)(self, *args, **kwargs)

    return type(f"Counting{base.__name__}", (base,), {name: counted})


def _one_step(strategy: SingleDeviceStrategy) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = Regressor()
    strategy.connect(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    batch = (torch.randn(8, 4), torch.randn(8, 1))

    def closure() -> torch.Tensor:
        loss, _ = strategy.forward_backward(batch, 0, lambda output: output, optimizer)
        return loss

    strategy.optimizer_step(optimizer, closure)
    return [parameter.detach().clone() for parameter in module.parameters()]


@pytest.mark.parametrize(("owner", "name"), PASS_THROUGHS)
def test_an_overridden_pass_through_layer_of_the_step_is_called_and_the_step_is_unchanged(owner, name):
    from phalanx.plugins.precision.precision import Precision

    calls: list[str] = []
    if owner == "strategy":
        strategy = _counting(SingleDeviceStrategy, name, calls)(torch.device("cpu"))
    else:
        strategy = SingleDeviceStrategy("cpu", precision_plugin=_counting(Precision, name, calls)())
    weights = _one_step(strategy)
    assert calls.count(name) >= 1, calls
    assert all(torch.equal(a, b) for a, b in zip(weights, _one_step(SingleDeviceStrategy("cpu"))))


def test_the_plain_step_calls_none_of_the_pass_through_layers():
    import sys

    from phalanx.plugins.precision.precision import Precision

    plain = {
        getattr(SingleDeviceStrategy if owner == "strategy" else Precision, name).__code__
        for owner, name in PASS_THROUGHS
    }
    seen: list[str] = []

    def spy(frame, event, arg):
        if event == "call" and frame.f_code in plain:
            seen.append(frame.f_code.co_name)

    strategy = SingleDeviceStrategy("cpu")
    sys.setprofile(spy)
    try:
        _one_step(strategy)
    finally:
        sys.setprofile(None)
    assert seen == [], seen
