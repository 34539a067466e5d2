"""EarlyStopping: stop ``fit`` when a monitored metric stops improving."""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.callbacks.callback import Callback
from phalanx.utilities.checks import is_int_at_least
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import log, rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


class EarlyStoppingReason(str, Enum):
    """Why EarlyStopping asked the Trainer to stop."""

    NOT_STOPPED = "not_stopped"
    STOPPING_THRESHOLD = "stopping_threshold"
    DIVERGENCE_THRESHOLD = "divergence_threshold"
    PATIENCE_EXHAUSTED = "patience_exhausted"
    NON_FINITE_METRIC = "non_finite_metric"


def _stage_name(trainer: Any) -> str:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return str(getattr(fn, "value", fn))


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` checks.

    Args:
        monitor: Key of ``trainer.callback_metrics`` to watch.
        min_delta: Smallest change that counts as an improvement.
        patience: Number of checks without improvement after which training stops. With validation, a check
            happens after each validation run.
        verbose: Report each decision.
        mode: "min" or "max": whether the metric should go down or up.
        strict: Raise when ``monitor`` is missing from the metrics (otherwise warn when verbose and skip).
        check_finite: Stop when the metric becomes NaN or infinite.
        stopping_threshold: Stop as soon as the metric is better than this value.
        divergence_threshold: Stop as soon as the metric is worse than this value.
        check_on_train_epoch_end: Check at the end of the training epoch rather than after validation (the default
            when validation does not run during ``fit``).
        log_rank_zero_only: Report only from rank 0.
    """

    mode_dict = {"min": torch.lt, "max": torch.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        super().__init__()
        if mode not in self.mode_dict:
            raise ValueError(f"`mode` must be one of {list(self.mode_dict)}, got {mode!r}.")
        if not is_int_at_least(patience, 0):
            raise ValueError(f"`patience` must be an int >= 0, got {patience!r}.")
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        self._check_on_train_epoch_end = check_on_train_epoch_end

        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None
        # Stored with the sign that makes "current - min_delta beats best" the improvement test in both modes.
        self.min_delta *= 1 if self.monitor_op == torch.gt else -1
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    @property
    def monitor_op(self) -> Any:
        return self.mode_dict[self.mode]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Checked whole before anything is assigned: a damaged entry leaves the callback as it was.
        missing = [key for key in ("wait_count", "stopped_epoch", "best_score", "patience") if key not in state_dict]
        if missing:
            raise CheckpointError(f"the EarlyStopping state lacks {missing}")
        for key in ("wait_count", "stopped_epoch", "patience"):
            value = state_dict[key]
            if not is_int_at_least(value, 0):
                raise CheckpointError(f"the EarlyStopping state's {key!r} is {value!r}; expected an int >= 0")
        best = state_dict["best_score"]
        if (
            isinstance(best, bool)
            or not isinstance(best, (Tensor, int, float))
            or (isinstance(best, Tensor) and best.numel() != 1)
        ):
            raise CheckpointError(
                f"the EarlyStopping state's 'best_score' is a {type(best).__name__}; expected a number"
            )
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.best_score = best.detach().reshape(()).clone() if isinstance(best, Tensor) else torch.tensor(float(best))
        self.patience = state_dict["patience"]

    # ------------------------------------------------------------------ hooks
    def _runs_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._check_on_train_epoch_end is not None:
            return bool(self._check_on_train_epoch_end)
        return not bool(getattr(trainer, "validation_enabled", False))

    def _should_skip_check(self, trainer: Trainer) -> bool:
        return _stage_name(trainer) != "fit" or bool(trainer.sanity_checking)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._should_skip_check(trainer) or not self._runs_on_train_epoch_end(trainer):
            return
        self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._should_skip_check(trainer) or self._runs_on_train_epoch_end(trainer):
            return
        self._run_early_stopping_check(trainer)

    # ------------------------------------------------------------------ the check
    def _validate_condition_metric(self, logs: dict[str, Any]) -> bool:
        if logs.get(self.monitor) is not None:
            return True
        message = (
            f"EarlyStopping is conditioned on metric {self.monitor!r}, which is not available. Log it with"
            f" `self.log({self.monitor!r}, value)` or monitor one of the available metrics: {sorted(logs)}."
        )
        if self.strict:
            raise RuntimeError(message)
        if self.verbose:
            rank_zero_warn(message)
        return False

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        logs = trainer.callback_metrics
        if trainer.fast_dev_run or not self._validate_condition_metric(logs):
            return
        value = logs[self.monitor]
        current = value.detach().squeeze() if isinstance(value, Tensor) else torch.tensor(float(value))
        should_stop, reason = self._evaluate_stopping_criteria(current)

        # Stop if any rank wants to: ranks that disagree would deadlock in the next collective.
        should_stop = bool(trainer.strategy.reduce_boolean_decision(should_stop, all=False))
        trainer.should_stop = bool(trainer.should_stop) or should_stop
        if should_stop:
            self.stopped_epoch = trainer.current_epoch
            if self.stopping_reason == EarlyStoppingReason.NOT_STOPPED:
                # Another rank decided; this one did not produce a reason of its own.
                self.stopping_reason_message = self.stopping_reason_message or "Another process signalled to stop."
        if reason and self.verbose:
            self._log_info(trainer, reason)

    def _evaluate_stopping_criteria(self, current: Tensor) -> tuple[bool, str | None]:
        should_stop = False
        reason: str | None = None
        best = self.best_score.to(current.device)
        if self.check_finite and not torch.isfinite(current):
            should_stop = True
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            reason = (
                f"Monitored metric {self.monitor} = {current.item()} is not finite."
                f" Previous best value was {self.best_score.item():.3f}. Signaling Trainer to stop."
            )
        elif self.stopping_threshold is not None and self.monitor_op(current, self.stopping_threshold):
            should_stop = True
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            reason = (
                "Stopping threshold reached:"
                f" {self.monitor} = {current.item()} {self.order_dict[self.mode]} {self.stopping_threshold}."
                " Signaling Trainer to stop."
            )
        elif self.divergence_threshold is not None and self.monitor_op(-current, -self.divergence_threshold):
            should_stop = True
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            reason = (
                "Divergence threshold reached:"
                f" {self.monitor} = {current.item()} {self.order_dict[self.mode]} {self.divergence_threshold}."
                " Signaling Trainer to stop."
            )
        elif self.monitor_op(current - self.min_delta, best):
            reason = self._improvement_message(current)
            self.best_score = current.detach().cpu().clone()
            self.wait_count = 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                should_stop = True
                self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
                reason = (
                    f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records."
                    f" Best score: {self.best_score.item():.3f}. Signaling Trainer to stop."
                )
        if should_stop:
            self.stopping_reason_message = reason
        return should_stop, reason

    def _improvement_message(self, current: Tensor) -> str:
        if torch.isfinite(self.best_score):
            return (
                f"Metric {self.monitor} improved by {abs(self.best_score.item() - current.item()):.3f} >="
                f" min_delta = {abs(self.min_delta)}. New best score: {current.item():.3f}"
            )
        return f"Metric {self.monitor} improved. New best score: {current.item():.3f}"

    def _log_info(self, trainer: Trainer, message: str) -> None:
        world_size = getattr(trainer, "world_size", 1) or 1
        if world_size > 1:
            message = f"[rank: {trainer.global_rank}] {message}"
        if self.log_rank_zero_only:
            rank_zero_info(message)
        else:
            log.info(message)
