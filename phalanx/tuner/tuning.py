"""Tuner: finds a learning rate for a model before its fit, leaving the model and the Trainer as they were."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.callbacks._lr_sweep import LRFinderResult
from phalanx.callbacks.lr_finder import LearningRateFinder

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def _check_method(method: str, tool: str) -> None:
    if method != "fit":
        raise ValueError(f"{tool} tunes for fit only; got method={method!r}, choose 'fit'.")


class Tuner:
    """Lightning's Tuner: ``Tuner(trainer).lr_find(model, ...)`` returns the sweep's result (see
    :class:`~phalanx.callbacks.LearningRateFinder`)."""

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
        finder.lr_find(self._trainer, model, kwargs)
        return finder.optimal_lr
