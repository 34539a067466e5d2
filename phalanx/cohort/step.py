"""The Cohort's one training step: a TrainingModule's ``training_step`` and backward, run by the strategy together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from phalanx.cohort.guards import record_loss

if TYPE_CHECKING:
    from phalanx.cohort.cohort import Cohort


def forward_backward(cohort: Cohort, batch: Any, batch_idx: int = 0) -> Tensor | None:
    """Run ``Strategy.forward_backward`` for ``cohort``'s module: the step a hand-written loop shares with the Trainer
    (and that a strategy running forward and backward in one schedule implements); the detached loss, or None."""
    strategy = cohort.strategy
    module = cohort._module
    # Lazy for import time: `from phalanx import Cohort` does not load the TrainingModule.
    from phalanx.module import TrainingModule

    if module is None or not isinstance(strategy.module, TrainingModule):
        raise RuntimeError(
            "Cohort.forward_backward runs a TrainingModule's training_step: call cohort.setup(module, optimizer)"
            " with a phalanx.TrainingModule first, or call cohort.backward(loss) on a loss you computed."
        )
    with module.cohort_backward_context():
        loss, _ = strategy.forward_backward(batch, batch_idx, _loss_in, None)
    if loss is None:
        return None
    cohort._last_loss = loss = loss.detach()
    record_loss(cohort, loss)
    return loss


def _loss_in(output: Any) -> Tensor | None:
    # What is backpropagated: training_step's tensor, or its dict's 'loss'; None skips the batch.
    loss = output.get("loss") if isinstance(output, dict) else output
    if output is not None and not isinstance(loss, Tensor):
        raise TypeError(
            f"training_step returned a {type(output).__name__} without a loss tensor; return the loss tensor, a dict"
            " with 'loss', or None to skip the batch."
        )
    return loss
