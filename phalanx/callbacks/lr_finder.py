"""LearningRateFinder: Lightning's callback that sweeps learning rates when fit starts and sets the suggested one."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from phalanx.callbacks._lr_sweep import (
    LRFinderResult,
    check_sweep_arguments,
    find_lr_attribute,
    run_sweep,
    tuning_strategy,
    update_lr,
)
from phalanx.callbacks.callback import Callback
from phalanx.utilities.seed import isolate_rng

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class LearningRateFinder(Callback):
    """Sweep the learning rate from ``min_lr`` to ``max_lr`` over ``num_training_steps`` steps at fit start.

    The sweep trains a copy of the model on a quiet Trainer (no logger, checkpoints or progress bar), so the model,
    its optimizer and the Trainer's counters are as before it; with ``update_attr`` the model's ``lr`` or
    ``learning_rate`` (or ``attr_name``) and the optimizer's rates become the suggestion. ``optimal_lr`` holds the
    result (``results``, ``suggestion()``, ``plot()``). The sweep stops early when the smoothed loss exceeds
    ``early_stop_threshold`` times the best one (None: never). On ``ddp`` every rank trains its shard, as in Lightning:
    all stop when one diverges, and rank 0's curve and suggestion are every rank's. Refused on strategies that cannot
    run such a fit beside them (spawned processes, sharded models).
    """

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        check_sweep_arguments(min_lr, max_lr, num_training_steps, mode)
        self._min_lr = min_lr
        self._max_lr = max_lr
        self._num_training_steps = num_training_steps
        self._mode = mode
        self._early_stop_threshold = early_stop_threshold
        self._update_attr = update_attr
        self._attr_name = attr_name
        self.optimal_lr: LRFinderResult | None = None

    def lr_find(self, trainer: Trainer, pl_module: Any, fit_kwargs: dict[str, Any] | None = None) -> None:
        """Run the sweep for ``pl_module`` on ``trainer``'s data (or ``fit_kwargs``') and keep its result."""
        if trainer.fast_dev_run:
            warnings.warn("The learning rate finder is skipped with fast_dev_run.", stacklevel=2)
            return
        tuning_strategy(trainer, "learning rate finder")  # refused here, before any work, where it cannot run
        attr_name = find_lr_attribute(pl_module, self._attr_name) if self._update_attr else ""
        if fit_kwargs is None:
            source = trainer._run.data_source
            datamodule = source.datamodule if source is not None else None
            train = source.dataloaders.get("train") if source is not None else None
            fit_kwargs = {"datamodule": datamodule} if datamodule is not None else {"train_dataloaders": train}
        result = LRFinderResult(self._mode, self._min_lr, self._max_lr, self._num_training_steps)
        # As Lightning's finder: what the sweep draws (its loader's shuffle and seeds) changes no draw of the fit after.
        with isolate_rng():
            run_sweep(trainer, pl_module, result, self._early_stop_threshold, fit_kwargs)
        self.optimal_lr = result
        if self._update_attr:
            update_lr(trainer, pl_module, attr_name, result)

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.lr_find(trainer, pl_module)
