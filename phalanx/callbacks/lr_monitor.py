"""LearningRateMonitor: log each optimizer's learning rate (and optionally momentum and weight decay)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from torch import Tensor
from torch.optim import Optimizer

from phalanx.callbacks.callback import Callback
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def _number(value: Any) -> float:
    if isinstance(value, Tensor):
        return float(value.item())
    return float(value)


class LearningRateMonitor(Callback):
    """Log learning rates to the Trainer's loggers as ``lr-{OptimizerClass}`` (``/pg{N}`` per parameter group).

    Args:
        logging_interval: "step" logs every ``trainer.log_every_n_steps`` steps, "epoch" at the start of each epoch,
            None follows each scheduler's own interval (optimizers without a scheduler are logged every epoch).
        log_momentum: Also log ``{name}-momentum`` (``betas[0]`` for Adam-like optimizers).
        log_weight_decay: Also log ``{name}-weight_decay``.

    A scheduler configuration with a ``name`` gives its optimizer that name instead. Several optimizers of one class
    get ``-1``, ``-2``... suffixes; parameter groups with a ``"name"`` key use it instead of ``pg{N}``.
    """

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"`logging_interval` must be 'step', 'epoch' or None, got {logging_interval!r}.")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}
        self._last_logged_step: int | None = None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.loggers:
            raise RuntimeError(
                "LearningRateMonitor needs a logger to write to, but the Trainer has none: pass `logger=True` (or a"
                " logger) to the Trainer, or remove the LearningRateMonitor callback."
            )
        if self.log_momentum:
            without = [
                type(opt).__name__
                for opt in trainer.optimizers
                if not any("momentum" in g or "betas" in g for g in opt.param_groups)
            ]
            if without:
                rank_zero_warn(
                    f"LearningRateMonitor(log_momentum=True): the optimizers {without} have no momentum; their"
                    " momentum is logged as 0."
                )
        names = [name for names_of_opt, _ in self._named_optimizers(trainer) for name in names_of_opt]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}
        self._last_logged_step = None

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if self.logging_interval == "epoch":
            return
        every = trainer.log_every_n_steps
        # Same cadence and step as the Trainer's own metric logging (Lightning's): the batches of the optimizer step
        # that completes N*k of them, or any once a stop is requested.
        stepped = trainer.fit_loop.batches_stepped
        if not every or ((stepped + 1) % every != 0 and not trainer.should_stop):
            return
        if self._last_logged_step == stepped:
            return  # several batches per step while accumulating gradients: log once
        self._last_logged_step = stepped
        self._log(trainer, "step" if self.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.logging_interval == "step":
            return
        self._log(trainer, "epoch" if self.logging_interval is None else "any")

    # ------------------------------------------------------------------ collecting
    def _log(self, trainer: Trainer, interval: str) -> None:
        stats = self._extract_stats(trainer, interval)
        if not stats:
            return
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.fit_loop.batches_stepped)

    def _extract_stats(self, trainer: Trainer, interval: str) -> dict[str, float]:
        """Values to log now: optimizers whose scheduler steps at ``interval`` ("any": all of them)."""
        stats: dict[str, float] = {}
        for names, (optimizer, opt_interval) in self._named_optimizers(trainer):
            if interval != "any" and opt_interval != interval:
                continue
            for name, group in zip(names, optimizer.param_groups):
                lr = _number(group["lr"])
                stats[name] = lr
                self.lrs.setdefault(name, []).append(lr)
                if self.log_momentum:
                    if "betas" in group:
                        momentum = _number(group["betas"][0])
                    else:
                        momentum = _number(group.get("momentum", 0.0))
                    stats[f"{name}-momentum"] = momentum
                    self.last_momentum_values[f"{name}-momentum"] = momentum
                if self.log_weight_decay:
                    decay = _number(group.get("weight_decay", 0.0))
                    stats[f"{name}-weight_decay"] = decay
                    self.last_weight_decay_values[f"{name}-weight_decay"] = decay
        return stats

    def _named_optimizers(self, trainer: Trainer) -> list[tuple[list[str], tuple[Optimizer, str]]]:
        """Each optimizer with its per-group names and the interval it is logged at (its scheduler's, or 'epoch')."""
        entries: list[tuple[str | None, Optimizer, str]] = []
        seen: list[Optimizer] = []
        for config in trainer.lr_scheduler_configs or []:
            optimizer = config.scheduler.optimizer
            seen.append(optimizer)
            entries.append((getattr(config, "name", None), optimizer, getattr(config, "interval", "epoch") or "epoch"))
        for optimizer in trainer.optimizers or []:
            # A strategy's wrapper (DeepSpeed's engine optimizer) shares the scheduled optimizer's parameter groups:
            # it is that optimizer, not one without a scheduler, and must not be logged a second time.
            if any(optimizer is other or optimizer.param_groups is other.param_groups for other in seen):
                continue
            entries.append((None, optimizer, "epoch"))

        counts: Counter[str] = Counter()
        result = []
        for explicit, optimizer, interval in entries:
            base = explicit if explicit is not None else f"lr-{type(optimizer).__name__}"
            occurrence = counts[base]
            counts[base] += 1
            if occurrence:
                base = f"{base}-{occurrence}"
            result.append((self._group_names(base, optimizer.param_groups), (optimizer, interval)))
        return result

    @staticmethod
    def _group_names(base: str, param_groups: Sequence[dict[str, Any]]) -> list[str]:
        named = [group.get("name") for group in param_groups]
        present = [n for n in named if n is not None]
        if len(present) != len(set(present)):
            duplicates = sorted({n for n in present if present.count(n) > 1})
            raise ValueError(
                f"The parameter groups of one optimizer must have unique names for LearningRateMonitor; {duplicates}"
                " appear more than once."
            )
        if len(param_groups) == 1:
            return [f"{base}/{named[0]}" if named[0] is not None else base]
        return [f"{base}/{name}" if name is not None else f"{base}/pg{i + 1}" for i, name in enumerate(named)]
