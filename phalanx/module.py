"""TrainingModule: the user's model, its steps, its optimizers and its hooks."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.module_clipping import clip_settings
from phalanx.module_loading import load_module_from_checkpoint
from phalanx.module_toggling import toggle_requires_grad, untoggle_requires_grad
from phalanx.utilities.apply import apply_to_tensors, move_to_device
from phalanx.utilities.hparams import AttributeDict, select_hyperparameters
from phalanx.utilities.metric_objects import loggable_items
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class TrainingModule(nn.Module):
    """An ``nn.Module`` that also says how to train, evaluate and predict with itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: Trainer | None = None
        self._current_fx: str | None = None
        self._hparams: AttributeDict = AttributeDict()
        self._hparams_for_checkpoint: dict[str, Any] = {}
        self.automatic_optimization: bool = True
        self._param_requires_grad_state: dict[nn.Parameter, bool] = {}

    # ------------------------------------------------------------------ steps (override)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the module's output; used by the step methods as you choose."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward().")

    def training_step(self, *args: Any, **kwargs: Any) -> Tensor | Mapping[str, Any] | None:
        """Compute and return the training loss (a tensor, a dict with 'loss', or None to skip the batch)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no training_step(batch, batch_idx): define it to return the loss"
            " (a tensor, or a dict with a 'loss' key) before calling Trainer.fit()."
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate one validation batch (log metrics with ``self.log``)."""

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate one test batch (log metrics with ``self.log``)."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return predictions for one batch (by default ``self(batch)``)."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, ``(optimizers, schedulers)`` or dicts with 'optimizer' and
        'lr_scheduler'."""
        raise NotImplementedError(
            f"{type(self).__name__} has no configure_optimizers(): define it to return an optimizer (or see the"
            " TrainingModule documentation for lists, schedulers and dicts)."
        )

    def configure_model(self) -> None:
        """Create layers here to have them built on the right device, in the right dtype, or sharded (must be
        idempotent)."""

    def configure_callbacks(self) -> Sequence[Any] | Any:
        """Return callbacks to add to the Trainer's (a callback of the same type replaces the Trainer's)."""
        return []

    def configure_gradient_clipping(
        self, optimizer: Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip gradients before the optimizer step (by default with the Trainer's settings)."""
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    def lr_scheduler_step(self, scheduler: Any, metric: Any | None) -> None:
        """Step ``scheduler`` (with the monitored ``metric`` for ReduceLROnPlateau-like schedulers)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Run backward on ``loss``; override for custom backward logic."""
        loss.backward(*args, **kwargs)

    # ------------------------------------------------------------------ hooks (override as needed)
    def prepare_data(self) -> None:
        """Download or prepare data once per node (before ``setup``)."""

    def setup(self, stage: str) -> None:
        """Called at the start of fit/validate/test/predict on every process ('fit', 'validate', 'test', 'predict')."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit/validate/test/predict."""

    def on_fit_start(self) -> None:
        """Called at the very start of fit."""

    def on_fit_end(self) -> None:
        """Called at the very end of fit."""

    def on_train_start(self) -> None:
        """Called when training starts (after the sanity check)."""

    def on_train_end(self) -> None:
        """Called when training ends."""

    def on_validation_start(self) -> None:
        """Called when a validation run starts."""

    def on_validation_end(self) -> None:
        """Called when a validation run ends."""

    def on_test_start(self) -> None:
        """Called when testing starts."""

    def on_test_end(self) -> None:
        """Called when testing ends."""

    def on_predict_start(self) -> None:
        """Called when predicting starts."""

    def on_predict_end(self) -> None:
        """Called when predicting ends."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch (after its validation)."""

    def on_validation_epoch_start(self) -> None:
        """Called at the start of a validation epoch."""

    def on_validation_epoch_end(self) -> None:
        """Called at the end of a validation epoch."""

    def on_test_epoch_start(self) -> None:
        """Called at the start of a test epoch."""

    def on_test_epoch_end(self) -> None:
        """Called at the end of a test epoch."""

    def on_predict_epoch_start(self) -> None:
        """Called at the start of a predict epoch."""

    def on_predict_epoch_end(self) -> None:
        """Called at the end of a predict epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Called before each training batch; return -1 to skip the rest of the epoch."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each validation batch."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each validation batch."""

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each test batch."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each test batch."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each predict batch."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each predict batch."""

    def on_before_backward(self, loss: Tensor) -> None:
        """Called before ``loss.backward()``."""

    def on_after_backward(self) -> None:
        """Called after backward, before the optimizer step."""

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called with final (unscaled) gradients, before clipping and the optimizer step."""

    def on_before_zero_grad(self, optimizer: Optimizer) -> None:
        """Called after the optimizer step, before gradients are cleared."""

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Callable[[], Any] | None = None
    ) -> None:
        """Step ``optimizer`` (runs ``optimizer_closure``: training_step and backward); override e.g. for LR warm-up."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Optimizer) -> None:
        """Clear the gradients after each optimizer step."""
        optimizer.zero_grad()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it is moved to the device (e.g. CPU augmentations); return the batch."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move the tensors of a batch (lists, tuples, dicts, namedtuples) to ``device``; override for other types."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch after it is on the device (e.g. GPU augmentations); return the batch."""
        return batch

    def on_validation_model_zero_grad(self) -> None:
        """Release gradients before validation during fit (called at the end of an accumulation window)."""
        self.zero_grad(set_to_none=True)

    def on_validation_model_eval(self) -> None:
        """Put the model in eval mode when validation starts."""
        self._model_to_switch().eval()

    def on_validation_model_train(self) -> None:
        """Put the model back in train mode when validation ends (by default each submodule's mode is restored)."""
        self._model_to_switch().train()

    def on_test_model_eval(self) -> None:
        """Put the model in eval mode when testing starts."""
        self._model_to_switch().eval()

    def on_test_model_train(self) -> None:
        """Put the model back in train mode when testing ends (by default each submodule's mode is restored)."""
        self._model_to_switch().train()

    def on_predict_model_eval(self) -> None:
        """Put the model in eval mode when predicting starts."""
        self._model_to_switch().eval()

    def on_predict_model_train(self) -> None:
        """Put the model back in train mode when predicting ends (by default each submodule's mode is restored)."""
        self._model_to_switch().train()

    def _model_to_switch(self) -> nn.Module:
        # The strategy's model (possibly a wrapper around this module), as Lightning's defaults switch trainer.model.
        model = self._trainer.model if self._trainer is not None else None
        return model if model is not None else self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to or change ``checkpoint`` before it is written (store only tensors and plain values)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` stored."""

    # ------------------------------------------------------------------ the Trainer
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module."""
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer: call trainer.fit/validate/test/predict first."
            )
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        self._trainer = trainer

    @property
    def device(self) -> torch.device:
        """The device of the module's parameters (CPU when it has none)."""
        for parameter in self.parameters():
            return parameter.device
        for buffer in self.buffers():
            return buffer.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's first floating-point parameter."""
        for parameter in self.parameters():
            if parameter.is_floating_point():
                return parameter.dtype
        return torch.get_default_dtype()

    @property
    def device_mesh(self) -> Any:
        """The strategy's DeviceMesh (ModelParallel: dims "data_parallel" and "tensor_parallel"), or None."""
        driver = self._driver()
        try:
            return driver.strategy.device_mesh if driver is not None else None
        except RuntimeError:  # a strategy whose mesh is not built yet: None, as Lightning's module answers
            return None

    def _driver(self) -> Any:
        # The Trainer running this module, else the phalanx.Cohort that set it up: both answer the rank questions.
        return self._trainer if self._trainer is not None else _cohort_of(self)

    @property
    def global_rank(self) -> int:
        """This process's global rank (0 when not attached)."""
        return getattr(self._driver(), "global_rank", 0)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (0 when not attached)."""
        return getattr(self._driver(), "local_rank", 0)

    @property
    def current_epoch(self) -> int:
        """The Trainer's current epoch (0 when not attached)."""
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        """The number of optimizer steps taken (0 when not attached)."""
        return getattr(self._driver(), "global_step", 0)

    @property
    def logger(self) -> Any:
        """The Trainer's (or Cohort's) first logger, or None."""
        return getattr(self._driver(), "logger", None)

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's (or Cohort's) loggers."""
        return getattr(self._driver(), "loggers", [])

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on global rank 0 only."""
        if getattr(self._driver(), "is_global_zero", True):
            print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Gather tensors (possibly nested in containers) from every process, stacked on a new first dimension."""
        driver = self._driver()
        if driver is None:
            raise RuntimeError(f"{type(self).__name__}.all_gather needs a running Trainer or a Cohort that set it up.")
        strategy = driver.strategy
        return apply_to_tensors(data, lambda t: strategy.all_gather(t, group=group, sync_grads=sync_grads))

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        add_dataloader_idx: bool = True,
        metric_attribute: str | None = None,
    ) -> None:
        """Record a scalar or a torchmetrics ``Metric`` for the progress bar, the loggers and ``callback_metrics``.

        In ``training_step`` values are kept per step by default, elsewhere averaged over the epoch (weighted by
        ``batch_size``, inferred when omitted); a ``Metric`` gives its forward value per step, ``compute()`` per epoch.
        """
        trainer = self._trainer
        if trainer is None or trainer._run.results is None:
            cohort = _cohort_of(self)
            if cohort is None:
                rank_zero_warn(f"self.log({name!r}, ...) was called outside a Trainer run and is ignored.")
                return
            cohort._log_from_module({name: value}, "log", logger=logger, sync_dist=sync_dist, reduce_fx=reduce_fx)
            return
        trainer._run.results.log(
            self._current_fx,
            name,
            value,
            prog_bar=prog_bar,
            logger=True if logger is None else logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            sync_dist=sync_dist,
            batch_size=batch_size,
            add_dataloader_idx=add_dataloader_idx,
            metric_attribute=metric_attribute,
        )

    def log_dict(self, dictionary: Mapping[str, Any] | Any, **kwargs: Any) -> None:
        """``self.log`` each item of ``dictionary`` (a mapping, or a torchmetrics ``MetricCollection``) alike."""
        dictionary = loggable_items(dictionary)
        cohort = _cohort_of(self) if self._trainer is None or self._trainer._run.results is None else None
        if cohort is not None:
            cohort._log_from_module(dictionary, "log_dict", **kwargs)  # one entry, as Cohort.log_dict writes
            return
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ hyper-parameters
    @property
    def hparams(self) -> AttributeDict:
        """Hyper-parameters recorded by ``save_hyperparameters`` (attribute access: ``self.hparams.lr``)."""
        return self._hparams

    def save_hyperparameters(
        self, *args: Any, ignore: Sequence[str] | str | None = None, frame: FrameType | None = None, logger: bool = True
    ) -> None:
        """Record the ``__init__`` arguments (or the names / dict given) as hyper-parameters, saved in checkpoints."""
        if frame is None:
            current = inspect.currentframe()
            frame = current.f_back if current is not None else None
        values = select_hyperparameters(args, ignore=ignore, frame=frame)
        self._hparams.update(values)
        self._log_hyperparams = logger

    # ------------------------------------------------------------------ optimization helpers
    def optimizers(self) -> Any:
        """The optimizer(s) from ``configure_optimizers``, wrapped so that ``step()`` goes through the strategy."""
        optimizers = self.trainer._run.manual_optimizers
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def lr_schedulers(self) -> Any:
        """The LR scheduler(s) from ``configure_optimizers`` (None when there are none)."""
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward for manual optimization: use instead of ``loss.backward()`` (precision and strategy apply)."""
        if self.automatic_optimization:
            raise RuntimeError("manual_backward is for manual optimization: set self.automatic_optimization = False.")
        self.trainer._manual_backward(loss, *args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only ``optimizer``'s parameters require gradients (those of the Trainer's other optimizers stop)."""
        self._param_requires_grad_state = toggle_requires_grad(self.trainer.optimizers, optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back the ``requires_grad`` they had before ``toggle_optimizer``."""
        untoggle_requires_grad(self.trainer.optimizers, optimizer, self._param_requires_grad_state)
        self._param_requires_grad_state = {}

    @contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer`` for the ``with`` block, ``untoggle_optimizer`` after it (even if it raises)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def freeze(self) -> None:
        """Stop every parameter from requiring gradients and switch to eval mode (e.g. for inference)."""
        for parameter in self.parameters():
            parameter.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Let every parameter require gradients again and switch to train mode."""
        for parameter in self.parameters():
            parameter.requires_grad = True
        self.train()

    def clip_gradients(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | int | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip ``optimizer``'s gradients by norm or value; arguments left out are the Trainer's (see clip_settings)."""
        gradient_clip_val, algorithm = clip_settings(self, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val == 0:
            return
        strategy = self.__dict__.get("_strategy")
        if strategy is None:
            raise RuntimeError(
                f"{type(self).__name__}.clip_gradients needs the strategy that runs this module (its precision decides"
                " how to clip): call it while Trainer.fit runs, or after strategy.connect(module) in your own loop."
            )
        if algorithm == "norm":
            strategy.clip_gradients(self, optimizer, max_norm=gradient_clip_val)
        else:
            strategy.clip_gradients(self, optimizer, clip_val=gradient_clip_val)

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any | None = None, strict: bool = True, **overrides: Any
    ) -> TrainingModule:
        """Build the module from the hyper-parameters saved in a checkpoint (``overrides`` win) and load its weights."""
        return load_module_from_checkpoint(
            cls, checkpoint_path, map_location=map_location, strict=strict, overrides=overrides
        )


def _cohort_of(module: TrainingModule) -> Any:
    """The phalanx.Cohort that set ``module`` up, or None (not imported here: without it, no Cohort exists)."""
    metrics = sys.modules.get("phalanx.cohort.metrics")
    return metrics.cohort_of(module) if metrics is not None else None
