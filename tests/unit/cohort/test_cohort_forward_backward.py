"""Cohort.forward_backward: the strategy's one step from a hand-written loop trains like cohort.backward(loss)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of
from torch import nn

import phalanx


class Returning(Regressor):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.form == "none_on_odd" and batch_idx % 2:
            return None
        return {"loss": loss, "size": len(x)} if self.form == "dict" else loss


def _train(form: str, through_step: bool) -> tuple[list[float | None], list[torch.Tensor]]:
    phalanx.seed_everything(3)
    cohort = phalanx.Cohort(accelerator="cpu", devices=1)
    module = Returning(form)
    module, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    train, _ = loaders(n=32, batch_size=8, shuffle=False)
    losses: list[float | None] = []
    for batch_idx, batch in enumerate(train):
        if through_step:
            loss = cohort.forward_backward(batch, batch_idx)
        else:
            output = module.training_step(batch, batch_idx)
            loss = output["loss"] if isinstance(output, dict) else output
            if loss is not None:
                cohort.backward(loss)
                loss = loss.detach()
        losses.append(None if loss is None else loss.item())
        if loss is not None:
            assert not loss.requires_grad
            optimizer.step()
        optimizer.zero_grad()
    return losses, parameters_of(module)


@pytest.mark.parametrize("form", ["tensor", "dict", "none_on_odd"])
def test_forward_backward_trains_like_backward_on_the_loss(form):
    step_losses, step_weights = _train(form, through_step=True)
    plain_losses, plain_weights = _train(form, through_step=False)
    assert step_losses == pytest.approx(plain_losses)
    assert (None in step_losses) == (form == "none_on_odd")
    for a, b in zip(step_weights, plain_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Wrong(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return "a loss"


@pytest.mark.parametrize(
    ("module", "error", "message"),
    [
        (nn.Linear(4, 1), RuntimeError, "runs a TrainingModule's training_step"),
        (Wrong(), TypeError, "training_step returned a str without a loss tensor"),
    ],
)
def test_what_forward_backward_cannot_run_is_refused(module, error, message):
    cohort = phalanx.Cohort(accelerator="cpu", devices=1)
    cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    batch = (torch.randn(2, 4), torch.randn(2, 1))
    with pytest.raises(error, match=message):
        cohort.forward_backward(batch)


class OneStage(Regressor):
    """Keeps part of itself in configure_model, as a pipeline stage does (keep_stage removes the other stages' blocks
    and sets the parts only other stages hold to None)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra: nn.Module | None = nn.Linear(4, 4)

    def configure_model(self) -> None:
        self.extra = None
        del self.net._modules["3"]  # a numbered block another stage holds
        self.net.append(nn.AdaptiveAvgPool1d(1))  # no parameters: (batch, 16) -> (batch, 1)


def _whole_model_groups(module: nn.Module, grouped: bool) -> Any:
    named = list(module.named_parameters())
    if not grouped:
        return [p for _, p in named]
    return [{"params": [p for _, p in named if p.dim() > 1]}, {"params": [p for _, p in named if p.dim() <= 1]}]


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("call", ["setup", "setup_module"])
def test_an_optimizer_made_over_the_whole_model_keeps_what_configure_model_kept(call, grouped):
    cohort = phalanx.Cohort(accelerator="cpu", devices=1)
    module = OneStage()
    optimizer = torch.optim.AdamW(_whole_model_groups(module, grouped), lr=0.1)
    if call == "setup":
        _, optimizer = cohort.setup(module, optimizer)
    else:
        cohort.setup_module(module)
        optimizer = cohort.setup_optimizers(optimizer)
    kept = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in kept} == {id(p) for p in module.parameters()} and len(kept) == 2
    cohort.forward_backward((torch.randn(2, 4), torch.randn(2, 1)))
    optimizer.step()  # only the kept parameters have state
    assert {id(p) for p in optimizer.state} == {id(p) for p in module.parameters()}
