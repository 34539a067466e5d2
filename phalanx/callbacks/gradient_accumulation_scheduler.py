"""GradientAccumulationScheduler: change ``trainer.accumulate_grad_batches`` from epoch to epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.callbacks.callback import Callback
from phalanx.module import TrainingModule
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Accumulate gradients over a number of batches that changes with the epoch, as Lightning's callback does.

    Args:
        scheduling: ``{epoch: batches}``, epochs counted from 0: from that epoch on, each optimizer step accumulates
            the gradients of that many batches (the loss is divided by it). Without an entry for epoch 0, epoch 0
            accumulates 1 batch (Lightning adds ``{0: 1}`` to the dict it is given; so does this class).

    The window is set at the start of every epoch, and also when training starts, so that a run resumed inside an
    epoch accumulates as the epoch it resumes did. Refused, when fit sets up, with manual optimization, with a
    strategy that accumulates gradients itself (DeepSpeed), and together with ``Trainer(accumulate_grad_batches=n)``
    for ``n`` other than 1.

    Example: ``GradientAccumulationScheduler({4: 2})`` steps every batch in epochs 0-3, every 2 batches from epoch 4.
    """

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling:
            raise TypeError("GradientAccumulationScheduler(scheduling={}) is empty; pass {epoch: batches, ...}.")
        if any(isinstance(key, bool) or not isinstance(key, int) or key < 0 for key in scheduling):
            raise MisconfigurationError(
                f"GradientAccumulationScheduler: every epoch must be an int >= 0; got {list(scheduling)}."
            )
        values = list(scheduling.values())
        if any(isinstance(value, bool) or not isinstance(value, int) or value < 1 for value in values):
            raise MisconfigurationError(
                f"GradientAccumulationScheduler: every number of batches must be an int >= 1; got {values}."
            )
        if min(scheduling) != 0:
            scheduling.update({0: 1})  # in the caller's dict too, as Lightning does
        self.scheduling = scheduling
        self.epochs = sorted(scheduling)
        self._last_set: int | None = None

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether some epoch accumulates more than one batch."""
        return any(value > 1 for value in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The number of batches accumulated per optimizer step in ``epoch``."""
        for start in reversed(self.epochs):
            if epoch >= start:
                return self.scheduling[start]
        return 1

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":
            return
        if not module.automatic_optimization:
            raise RuntimeError(
                "GradientAccumulationScheduler changes the accumulation of automatic optimization; with"
                " self.automatic_optimization = False accumulate in training_step, or remove the callback."
            )
        strategy = trainer.strategy
        if strategy.traits.handles_gradient_accumulation:
            name = type(strategy).__name__
            raise RuntimeError(
                f"GradientAccumulationScheduler cannot change the accumulation between epochs with {name}, which fixes"
                " it when it is set up; pass a fixed Trainer(accumulate_grad_batches=n) instead."
            )
        if trainer.accumulate_grad_batches not in (1, self._last_set):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and GradientAccumulationScheduler"
                " both set the accumulation; remove one of them."
            )
        overridden = [name for name in ("optimizer_step", "optimizer_zero_grad") if _overrides(module, name)]
        if overridden and self.going_to_accumulate_grad_batches():
            rank_zero_warn(
                f"{type(module).__name__} overrides {' and '.join(overridden)}, which run once per optimizer step:"
                " while GradientAccumulationScheduler accumulates, they are not called after every batch."
            )

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # A run resumed inside an epoch does not call that epoch's on_train_epoch_start again.
        self._set(trainer, self.get_accumulate_grad_batches(trainer.current_epoch))

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._set(trainer, self.get_accumulate_grad_batches(trainer.current_epoch))

    def _set(self, trainer: Trainer, value: int) -> None:
        trainer.accumulate_grad_batches = value
        self._last_set = value


def _overrides(module: TrainingModule, name: str) -> bool:
    return callable(module.__dict__.get(name)) or getattr(type(module), name) is not getattr(TrainingModule, name)


__all__ = ["GradientAccumulationScheduler"]
