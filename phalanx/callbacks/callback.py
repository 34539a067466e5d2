"""Callback: code that plugs into the Trainer's hooks without changing the TrainingModule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


class Callback:
    """Base class: override the hooks you need; each receives the Trainer and the TrainingModule first."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in checkpoints (unique per callback instance that saves state)."""
        return type(self).__qualname__

    def _generate_state_key(self, **kwargs: Any) -> str:
        """A state key made of the class name and ``kwargs``, the settings that tell instances of one class apart."""
        # Two instances of one class with different settings (e.g. two ModelCheckpoints) must not share a key.
        return f"{type(self).__qualname__}{repr(kwargs)}"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called when fit/validate/test/predict begins."""

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called when fit/validate/test/predict ends."""

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when fit begins."""

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when fit ends."""

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called before the validation sanity check."""

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after the validation sanity check."""

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when training begins."""

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when training ends."""

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of each training epoch, after its validation."""

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        """Called before each training batch."""

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Called after each training batch (after the optimizer step)."""

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when a validation run begins."""

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when a validation run ends (its epoch metrics are in ``trainer.callback_metrics``)."""

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of a validation epoch."""

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of a validation epoch."""

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each validation batch."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each validation batch."""

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when testing begins."""

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when testing ends."""

    def on_test_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of a test epoch."""

    def on_test_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of a test epoch."""

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each test batch."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each test batch."""

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when predicting begins."""

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when predicting ends."""

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of a predict epoch."""

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of a predict epoch."""

    def on_predict_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before each predict batch."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each predict batch."""

    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: Tensor) -> None:
        """Called before backward."""

    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after backward."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """Called with final gradients before clipping and the optimizer step."""

    def on_before_zero_grad(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """Called after the optimizer step, before gradients are cleared."""

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """Called when the run raises."""

    def state_dict(self) -> dict[str, Any]:
        """Return state to keep in checkpoints (plain values and tensors only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by ``state_dict``."""

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Add to or change ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` stored (called before ``load_state_dict``)."""
