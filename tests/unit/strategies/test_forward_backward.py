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
