"""The metrics of a run as callbacks, loggers and the progress bar see them, and their delivery to the loggers.

:class:`~phalanx.trainer.logging.results.LoggedResults` records what ``self.log`` is given; the Trainer's
:class:`LoggedMetrics` publishes what those results hold at each step and epoch end into the dictionaries behind
``trainer.callback_metrics``, ``trainer.logged_metrics`` and ``trainer.progress_bar_metrics``, and sends the logged
ones to the loggers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.logging.results import LoggedResults
    from phalanx.trainer.trainer import Trainer


class LoggedMetrics:
    """The Trainer's published metrics: ``callback`` (every logged value), ``logged`` (``logger=True``) and
    ``progress_bar`` (``prog_bar=True``), with the step values still to send to the loggers."""

    def __init__(self, trainer: Trainer) -> None:
        # The loggers, the step and the epoch are read from the Trainer when metrics are sent.
        self._trainer = trainer
        self.callback: dict[str, Tensor] = {}
        self.logged: dict[str, Tensor] = {}
        self.progress_bar: dict[str, Tensor] = {}
        self._pending_step_log: dict[str, Tensor] = {}
        # Evaluation batches done per dataloader since the stage began, the loggers' step for their step values (as in
        # Lightning, where validation during fit counts on from one validation to the next).
        self._eval_batches: dict[int, int] = {}

    def reset(self) -> None:
        """Start empty (new dictionaries: one read before keeps the values it had), as a stage begins."""
        self.callback, self.logged, self.progress_bar = {}, {}, {}
        self._eval_batches = {}

    def publish_step(self, results: LoggedResults) -> None:
        """Publish the latest step values of ``results``; the logged ones wait for :meth:`log_step`."""
        callback, logged, bar = results.step_metrics()
        self.callback.update(callback)
        self.logged.update(logged)
        self.progress_bar.update(bar)
        self._pending_step_log.update(logged)

    def publish_eval_step(self, results: LoggedResults, dataloader_idx: int, sanity_checking: bool) -> None:
        """After an evaluation batch: publish its step values and send the logged ones to the loggers at once, at
        the step that counts the dataloader's evaluation batches (not during the sanity check)."""
        if results.step_updated:
            _, logged, bar = results.step_metrics()
            self.logged.update(logged)
            self.progress_bar.update(bar)
            if logged and not sanity_checking and self._trainer.loggers:
                self._send(logged, step=self._eval_batches.get(dataloader_idx, 0), with_epoch=False)
        if not sanity_checking:
            self._eval_batches[dataloader_idx] = self._eval_batches.get(dataloader_idx, 0) + 1

    def publish_epoch(self, results: LoggedResults) -> dict[str, Tensor]:
        """Publish the epoch aggregates of ``results``; return the logged ones (what ``validate`` and ``test`` return,
        as in Lightning)."""
        callback, logged, bar = results.epoch_metrics()
        self.callback.update(callback)
        self.logged.update(logged)
        self.progress_bar.update(bar)
        return logged

    def log_step(self) -> None:
        """Send the step values published since the last call to the loggers."""
        pending, self._pending_step_log = self._pending_step_log, {}
        if pending:
            self._send(pending)

    def log_epoch(self, results: LoggedResults, training: bool = False) -> None:
        """Send the logged epoch aggregates of ``results`` to the loggers."""
        _, logged, _ = results.epoch_metrics()
        if not logged:
            return
        # Lightning counts a training epoch's last optimizer step only after its batch, and takes it back for the
        # epoch's values: they land on the step of that batch, as its step values did.
        step = max(self._trainer.fit_loop.batches_stepped - 1, 0) if training else None
        self._send(logged, step=step)

    def log_hyperparameters(self, module: TrainingModule) -> None:
        """At the start of fit, as Lightning: each logger gets the hyperparameters of ``module`` and of the Trainer's
        datamodule (unless both were saved with ``logger=False``), then ``log_graph(module)``, then ``save()``."""
        trainer = self._trainer
        if not trainer.loggers:
            return
        datamodule = trainer.datamodule
        from_module = getattr(module, "_log_hyperparams", True)
        from_datamodule = datamodule is not None and getattr(datamodule, "_log_hyperparams", True)
        params = None
        if from_module or from_datamodule:
            params = {
                **(dict(module.hparams) if from_module else {}),
                **(datamodule.hparams if from_datamodule else {}),
            }
        # A graph is traced by a forward pass on rank 0 alone: where forward passes run collectives (sharded models on
        # several processes), that would wait forever for the other ranks, so no graph is traced there.
        strategy = trainer.strategy
        traced = strategy.world_size == 1 or not (
            strategy.traits.pads_evaluation or strategy.traits.requires_equal_batches
        )
        for logger in trainer.loggers:
            if params is not None:
                logger.log_hyperparams(params)
            if traced:
                logger.log_graph(module)
            logger.save()

    def _send(self, metrics: dict[str, Tensor], step: int | None = None, with_epoch: bool = True) -> None:
        trainer = self._trainer
        values = _host_floats(metrics)
        if with_epoch:
            values["epoch"] = float(trainer.current_epoch)
        if step is None:
            # Lightning's step for the loggers: the batches that stepped the optimizer, counted once the batch
            # (and the validation it triggers) is done, so LearningRateMonitor's points fall on the same steps.
            step = trainer.fit_loop.batches_stepped
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)


def _host_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """The values as Python floats, read with one host-device sync per device rather than one per value."""
    if len(metrics) == 1:
        ((name, value),) = metrics.items()
        return {name: float(value.item())}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in metrics.items():
        by_device.setdefault(value.device, []).append(name)
    read: dict[str, float] = {}
    for device, names in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        stacked = torch.stack([metrics[name].detach().reshape(()).to(dtype) for name in names])
        read.update(zip(names, stacked.tolist()))
    return {name: read[name] for name in metrics}


__all__ = ["LoggedMetrics"]
