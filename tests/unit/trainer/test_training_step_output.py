"""What training_step returns, as the fit loop takes it: a loss autograd cannot differentiate is refused before
backward, naming the hook, what it returned and what it must return; manual optimization may return anything."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx


class Net(phalanx.TrainingModule):
    def __init__(self, returns: Callable[[torch.Tensor], Any], manual: bool = False, backward_of=None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.returns = returns
        self.automatic_optimization = not manual
        self.backward_of = backward_of or (lambda loss: loss)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        errors = (self.net(x) - y) ** 2  # shape (batch, 1), part of the graph
        self.steps += 1
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self.backward_of(errors.mean()))
            optimizer.step()
        return self.returns(errors)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: Net) -> phalanx.Trainer:
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, **options)
    trainer.fit(module, data)
    return trainer


def _under_no_grad(errors: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return errors.mean() * 2


NO_GRAD = "that does not require grad and has no grad_fn"
TENSOR = "training_step returned a tensor"
DICT = "training_step returned a dict whose 'loss' is"
# (case, what training_step returns from its per-sample errors, the error, what its message says)
REFUSED = [
    ("detached", lambda e: e.mean().detach(), ValueError, f"{TENSOR} (dtype torch.float32) {NO_GRAD}"),
    ("under_no_grad", _under_no_grad, ValueError, f"{TENSOR} (dtype torch.float32) {NO_GRAD}"),
    ("integer_tensor", lambda e: torch.tensor(3), ValueError, f"{TENSOR} (dtype torch.int64) {NO_GRAD}"),
    ("per_sample", lambda e: e, ValueError, f"{TENSOR} of shape (8, 1), not a scalar"),
    ("per_sample_detached", lambda e: e.detach(), ValueError, f"{TENSOR} of shape (8, 1), not a scalar"),
    ("dict_detached", lambda e: {"loss": e.mean().detach()}, ValueError, f"{DICT} a tensor (dtype torch.float32)"),
    ("dict_per_sample", lambda e: {"loss": e.sum(dim=1)}, ValueError, f"{DICT} a tensor of shape (8,), not a scalar"),
    ("dict_none", lambda e: {"loss": None}, TypeError, f"{DICT} None, not a tensor"),
    ("dict_float", lambda e: {"loss": 0.5}, TypeError, f"{DICT} a float, not a tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "returns", "error", "message"), REFUSED, ids=[row[0] for row in REFUSED])
def test_automatic_optimization_refuses_a_loss_autograd_cannot_use(case, returns, error, message) -> None:
    module = Net(returns)
    weight = module.net.weight.detach().clone()
    with pytest.raises(error) as raised:
        _fit(module)
    assert message in str(raised.value)
    assert "must" in str(raised.value) or "Return the loss" in str(raised.value)  # it says what to return instead
    assert module.steps == 1 and torch.equal(module.net.weight, weight)  # refused at the first batch, before a step


# (case, what training_step returns, whether the weights move)
ACCEPTED = [
    ("scalar", lambda e: e.mean(), True),
    ("one_element", lambda e: e.mean().reshape(1), True),  # what torch's backward accepts
    ("dict_scalar", lambda e: {"loss": e.mean(), "extra": e.detach()}, True),
    ("none_skips_the_batch", lambda e: None, False),  # the optimizer steps without gradients, as in Lightning
]


@pytest.mark.parametrize(("case", "returns", "moves"), ACCEPTED, ids=[row[0] for row in ACCEPTED])
def test_automatic_optimization_takes_a_scalar_loss_or_none(case, returns, moves) -> None:
    module = Net(returns)
    weight = module.net.weight.detach().clone()
    trainer = _fit(module)
    assert module.steps == 2 and trainer.global_step == 2
    assert torch.equal(module.net.weight, weight) != moves


MANUAL = [
    ("nothing", lambda e: None),
    ("detached", lambda e: e.mean().detach()),
    ("per_sample", lambda e: e),
    ("dict_detached", lambda e: {"loss": e.mean().detach()}),
]


@pytest.mark.parametrize(("case", "returns"), MANUAL, ids=[row[0] for row in MANUAL])
def test_manual_optimization_may_return_anything(case, returns) -> None:
    module = Net(returns, manual=True)
    weight = module.net.weight.detach().clone()
    _fit(module)
    assert module.steps == 2 and not torch.equal(module.net.weight, weight)


def test_manual_backward_of_a_loss_without_grad_names_manual_backward() -> None:
    module = Net(lambda e: None, manual=True, backward_of=lambda loss: loss.detach())
    with pytest.raises(ValueError) as raised:
        _fit(module)
    assert "manual_backward(loss) got a tensor of shape () (dtype torch.float32) that does not require grad" in str(
        raised.value
    )
