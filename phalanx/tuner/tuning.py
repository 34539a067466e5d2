"""Tuner: finds a learning rate and a batch size for a model before its fit, leaving model and Trainer as before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from phalanx.callbacks._lr_sweep import LRFinderResult, tuning_strategy
from phalanx.callbacks.batch_size_finder import BatchSizeFinder
from phalanx.callbacks.lr_finder import LearningRateFinder

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def _check_method(method: str, tool: str) -> None:
    if method != "fit":
        raise ValueError(f"{tool} tunes for fit only; got method={method!r}, choose 'fit'.")


def _in_every_process(trainer: Trainer, tool: str, run: Callable[..., None], *args: Any) -> None:
    # As Lightning's tuner, which runs inside a fit: with several processes every rank tunes, so the run's launcher
    # starts them first (once: the fit after reuses them); refused before that where the strategy cannot tune.
    launcher = trainer.strategy.launcher if tuning_strategy(trainer, tool) is not None else None
    if launcher is None:
        run(*args)
    else:
        launcher.launch(run, *args)


class Tuner:
    """Lightning's Tuner: ``lr_find`` returns the sweep's result (see :class:`~phalanx.callbacks.LearningRateFinder`),
    ``scale_batch_size`` the batch size found (see :class:`~phalanx.callbacks.BatchSizeFinder`)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def lr_find(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinderResult | None:
        """Train a copy of ``model`` at rates rising from ``min_lr`` to ``max_lr`` for up to ``num_training`` steps.

        Returns the result (``results``, ``suggestion()``, ``plot()``), or None under ``fast_dev_run``; with
        ``update_attr`` the model's ``lr``/``learning_rate`` (or ``attr_name``) becomes the suggestion. The model,
        the Trainer's counters, loggers and checkpoint folder are left as they were. Validation is not run during the
        sweep (``val_dataloaders`` and ``dataloaders`` are accepted for Lightning's signature).
        """
        _check_method(method, "lr_find")
        finder = LearningRateFinder(min_lr, max_lr, num_training, mode, early_stop_threshold, update_attr, attr_name)
        if hasattr(train_dataloaders, "train_dataloader") and datamodule is None:  # a DataModule passed positionally
            datamodule, train_dataloaders = train_dataloaders, None
        kwargs = {"datamodule": datamodule} if datamodule is not None else {"train_dataloaders": train_dataloaders}
        _in_every_process(self._trainer, "learning rate finder", finder.lr_find, self._trainer, model, kwargs)
        return finder.optimal_lr

    def scale_batch_size(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """Find the largest batch size that trains (see :class:`~phalanx.callbacks.BatchSizeFinder` for the modes and
        bounds), set it on the model's, its hparams' or the datamodule's ``batch_arg_name`` and return it (None under
        ``fast_dev_run``). The model and the Trainer are left as they were."""
        _check_method(method, "scale_batch_size")
        finder = BatchSizeFinder(mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)
        if hasattr(train_dataloaders, "train_dataloader") and datamodule is None:  # a DataModule passed positionally
            datamodule, train_dataloaders = train_dataloaders, None
        trainer, scale = self._trainer, finder.scale_batch_size
        _in_every_process(trainer, "batch size finder", scale, trainer, model, datamodule, train_dataloaders)
        return None if self._trainer.fast_dev_run else finder.optimal_batch_size
