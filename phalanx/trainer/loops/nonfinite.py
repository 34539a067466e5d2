"""What the fit loop does with a NaN or infinite training loss: ``Trainer(nonfinite_loss=...)``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from phalanx.utilities.nonfinite import LossFinitenessSum

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

_ADVICE = "pass nonfinite_loss='skip', 'stop' or 'raise' to act on it, or 'ignore' to silence this warning"


class SkippedBatch(Exception):  # noqa: N818 - control flow inside the fit loop, never seen by users
    """Raised by the fit loop between a batch's forward and its backward: the batch must not update the weights."""

    def __init__(self, output: Any) -> None:
        super().__init__("skipped batch")
        self.output = output


def _ignore(loss: Tensor) -> None:
    """What ``NonFiniteLossCheck.record`` is where nothing is summed."""


class NonFiniteLossCheck:
    """Watches the training loss of one ``fit``.

    'warn' adds one device-side operation per batch (a running sum) and reads it only where the loop reads values on the
    host anyway (every ``log_every_n_steps`` optimizer steps, at epoch ends and checkpoint saves): it never synchronises
    a step.
    'skip', 'stop' and 'raise' read every loss on the host (and agree across processes), i.e. synchronise every step.
    """

    def __init__(self, trainer: Trainer, global_step: int) -> None:
        self.trainer = trainer
        self.mode: str = trainer.nonfinite_loss
        self._finite = LossFinitenessSum()  # the losses since the window started, on the loss's device
        self._window_start = global_step
        self.skipped = 0  # batches skipped for a non-finite loss ('skip')
        # Plain attributes, not a property and a method around the sum's: the fit loop reads them for every batch.
        #: Whether each loss is read on the host (and the decision agreed on by every process).
        self.checks_every_step = self.mode in ("skip", "stop", "raise")
        #: 'warn': add the loss into a running sum on its device, without reading it (one small kernel per batch);
        #: nothing in the other modes, or once the warning was given.
        self.record: Callable[[Tensor], None] = self._finite.record if self.mode == "warn" else _ignore
        #: ``loss.detach()``; after ``record(loss)``, the detached copy the record made (one detach op per batch).
        self.detach: Callable[[Tensor], Tensor] = self._finite.detached if self.mode == "warn" else Tensor.detach

    def report(self) -> None:
        """'warn': read the sum (called where the loop already reads values on the host) and warn once per fit."""
        recorded = self._finite.recorded
        with self.trainer.strategy.host_reads():
            finite = self._finite.read()
        if finite is None:
            return
        start, end = self._window_start, self.trainer.fit_loop.global_step
        if not finite:
            trainer = self.trainer
            rank = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
            warnings.warn(
                f"{rank}The training loss was NaN or infinite at least once in the {recorded} batches between"
                f" global step {start} and {end} (epoch {trainer.current_epoch}); those updates were applied and"
                f" training goes on (nonfinite_loss='warn'). This is reported once per fit: {_ADVICE}.",
                UserWarning,
                stacklevel=2,
            )
            self.mode, self.record, self.detach = "warned", _ignore, Tensor.detach  # once per fit: stop summing
            return
        self._window_start = end

    def all_finite(self, loss: Tensor) -> bool:
        """Read ``loss`` on the host; True when it is finite on every process (every process must call this)."""
        finite = bool(torch.isfinite(loss).all())
        return bool(self.trainer.strategy.reduce_boolean_decision(finite, all=True))

    def act(self, loss: Tensor, batch_idx: int) -> None:
        """A non-finite loss was found: raise ('raise'), count it ('skip') or ask the loop to stop after this batch
        ('stop')."""
        trainer = self.trainer
        step, epoch = trainer.fit_loop.global_step, trainer.current_epoch
        if self.mode == "raise":
            own = torch.isfinite(loss).all()
            value = (
                f"{loss.detach().float().cpu().tolist()}"
                if not own
                else "finite here but NaN or infinite on another process"
            )
            raise FloatingPointError(
                f"The training loss is {value} at global step {step} (epoch {epoch}, batch_idx {batch_idx}); "
                "nonfinite_loss='raise' stops training here. The weights hold the last finite update: "
                "lower the learning rate, clip gradients (gradient_clip_val), "
                "or pass detect_anomaly=True to find the operation at fault."
            )
        if self.mode == "skip":
            self.skipped += 1
            if self.skipped == 1:
                warnings.warn(
                    f"The training loss is NaN or infinite at global step {step} (epoch {epoch}, "
                    f"batch_idx {batch_idx}): the batch (and the rest of its gradient accumulation window) is "
                    "skipped, and so is any later one (nonfinite_loss='skip'; this is reported once per fit, "
                    "trainer.fit_loop.nonfinite.skipped counts them).",
                    UserWarning,
                    stacklevel=2,
                )
            return
        if self.mode == "stop":
            warnings.warn(
                f"The training loss is NaN or infinite at global step {step} (epoch {epoch}, batch_idx {batch_idx}):"
                " this batch is not applied and training stops (nonfinite_loss='stop').",
                UserWarning,
                stacklevel=2,
            )
            trainer._run.should_stop = True
            trainer._run.stop_now = True


def check_nonfinite_mode(trainer: Trainer, automatic: bool) -> None:
    """Refuse the combinations that cannot work, at the start of ``fit``."""
    mode = trainer.nonfinite_loss
    if mode != "skip":
        return
    if not automatic:
        raise ValueError(
            "nonfinite_loss='skip' needs automatic optimization: with self.automatic_optimization = False, "
            "training_step steps the optimizers itself before the loop sees the loss. Check the loss there, "
            "or pass nonfinite_loss='stop' or 'raise' (checked on the loss training_step returns, "
            "after its own steps)."
        )
    if trainer.strategy.traits.handles_gradient_accumulation:
        raise ValueError(
            f"nonfinite_loss='skip' cannot skip a batch under {type(trainer.strategy).__name__}: "
            f"its engine counts every batch (gradient accumulation, loss scaling). "
            "Pass nonfinite_loss='stop' or 'raise' instead."
        )


__all__ = ["NonFiniteLossCheck", "SkippedBatch", "check_nonfinite_mode"]
