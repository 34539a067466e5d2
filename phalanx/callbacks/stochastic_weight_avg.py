"""StochasticWeightAveraging: average the weights of the last epochs under an SWA learning-rate schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR

from phalanx.callbacks.callback import Callback
from phalanx.optimization import LRSchedulerConfig
from phalanx.utilities.dtensor import is_dtensor
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

_CPU = torch.device("cpu")

#: ``avg_fn(averaged_parameter, model_parameter, num_averaged) -> new averaged parameter``.
AverageFunction = Callable[[Tensor, Tensor, Tensor], Tensor]


class StochasticWeightAveraging(Callback):
    """Stochastic Weight Averaging (Izmailov et al., 2018) as Lightning's callback does it.

    From epoch ``swa_epoch_start`` on, the optimizer's learning rate follows ``torch.optim.swa_utils.SWALR`` towards
    ``swa_lrs`` (it replaces the module's LR scheduler), and at the start of each epoch up to the last the weights
    are added to a running average. When training ends the average replaces the module's weights; a module with
    batch-norm layers trains one more epoch (``max_epochs + 1``) forward only, to recompute their statistics for the
    averaged weights, as Lightning does (``trainer.current_epoch`` is then ``max_epochs + 1`` after ``fit``).

    Args:
        swa_lrs: The SWA learning rate: one float for every parameter group, or a list of one per group.
        swa_epoch_start: The epoch averaging starts at: an int counted from 1, or a fraction of ``max_epochs``.
        annealing_epochs: Epochs over which the learning rate moves to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"`` annealing.
        avg_fn: ``avg_fn(averaged, current, num_averaged)`` (default: the equally weighted mean).
        device: Where the average is kept (default: the CPU); None keeps it on the module's device.

    The average, its count and the SWA scheduler's state are saved in checkpoints: a run resumed in the middle of the
    averaging (even inside an epoch, or inside the batch-norm epoch) continues exactly. One optimizer and at most one
    LR scheduler; refused when fit sets up with a strategy that shards the model or wraps it in an engine (FSDP,
    ``model_parallel``, DeepSpeed), whose processes each hold part of the parameters.
    """

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: AverageFunction | None = None,
        device: torch.device | str | None = _CPU,
    ) -> None:
        _check_arguments(swa_lrs, swa_epoch_start, annealing_epochs, annealing_strategy, avg_fn, device)
        self.n_averaged: Tensor | None = None
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._model_contains_batch_norm: bool | None = None
        self._average: dict[str, Tensor] | None = None  # the averaged parameters, by name
        self._initialized = False
        self._swa_scheduler: SWALR | None = None
        self._scheduler_state: dict[str, Any] | None = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self.momenta: dict[nn.modules.batchnorm._BatchNorm, float | None] = {}
        self._max_epochs = -1
        self._raised_max_epochs = False

    @property
    def swa_start(self) -> int:
        """The first epoch (from 0) of the averaging."""
        assert isinstance(self._swa_epoch_start, int), "swa_start is known once fit starts"
        return max(self._swa_epoch_start - 1, 0)

    @property
    def swa_end(self) -> int:
        """The last epoch (from 0) of the averaging (``inf`` when ``max_epochs=-1``)."""
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1  # type: ignore[return-value]

    @staticmethod
    def pl_module_contains_batch_norm(module: nn.Module) -> bool:
        """Whether ``module`` has batch-norm layers (Lightning's name)."""
        return any(isinstance(layer, nn.modules.batchnorm._BatchNorm) for layer in module.modules())

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        strategy = trainer.strategy
        if stage == "fit" and strategy.traits.restore_checkpoint_after_setup:
            raise MisconfigurationError(
                f"StochasticWeightAveraging does not support {type(strategy).__name__}, which shards the model across"
                " processes (or wraps it in an engine) when it is set up: the average is kept as one process holds"
                " the parameters. Use strategy='ddp' or 'single_device'."
            )

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationError(
                f"StochasticWeightAveraging works with one optimizer; configure_optimizers returned"
                f" {len(trainer.optimizers)}."
            )
        if len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationError(
                f"StochasticWeightAveraging replaces the LR scheduler with SWALR, so it works with at most one;"
                f" configure_optimizers returned {len(trainer.lr_scheduler_configs)}."
            )
        if isinstance(self._swa_epoch_start, float):
            if trainer.max_epochs == -1:
                raise MisconfigurationError(
                    f"StochasticWeightAveraging(swa_epoch_start={self._swa_epoch_start}) is a fraction of max_epochs,"
                    " but max_epochs=-1 sets no limit; pass swa_epoch_start as an int epoch."
                )
            self._swa_epoch_start = int(trainer.max_epochs * self._swa_epoch_start)
        self._model_contains_batch_norm = self.pl_module_contains_batch_norm(module)
        self._max_epochs = trainer.max_epochs
        if self._model_contains_batch_norm and trainer.max_epochs != -1:
            # One more epoch, forward only, recomputes the batch-norm statistics of the averaged weights.
            trainer.max_epochs += 1
            self._raised_max_epochs = True
        if self._scheduler_state is not None:
            # Resumed while averaging: the checkpoint's scheduler and optimizer states are those of SWALR, which the
            # Trainer loads next, into the scheduler made here.
            self._start(trainer, module)

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._in_batch_norm_epoch(trainer) and trainer.fit_loop.batches_done > 0:
            # Resumed inside the batch-norm epoch (its on_train_epoch_start does not run again): go on with it.
            self._save_momenta(module)
            trainer.fit_loop.skip_backward()

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        epoch = trainer.current_epoch
        if not self._initialized and self.swa_start <= epoch <= self.swa_end:
            self._start(trainer, module)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            assert self.n_averaged is not None and self._average is not None
            self.update_parameters(self._average, module, self.n_averaged, self._avg_fn)
            self._latest_update_epoch = epoch
        if self._in_batch_norm_epoch(trainer):
            assert self._average is not None
            self.transfer_weights(self._average, module)
            self.reset_batch_norm_and_save_state(module)
            trainer.fit_loop.skip_backward()

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        # The loop counts the epoch it ended: current_epoch - 1 is the last one trained.
        last = trainer.current_epoch - 1
        if self._model_contains_batch_norm and self._max_epochs != -1 and last == self.swa_end + 1:
            self.reset_momenta()
        elif (last == self.swa_end or self._max_epochs == -1) and self._average is not None:
            self.transfer_weights(self._average, module)
        self._restore_max_epochs(trainer)

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._restore_max_epochs(trainer)  # a fit that trained nothing has no on_train_end

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._restore_max_epochs(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_averaged": 0 if self.n_averaged is None else int(self.n_averaged.item()),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
            "average_model_state": None if self._average is None else {k: _copy(v) for k, v in self._average.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_n_averaged = int(state_dict["n_averaged"])
        self._latest_update_epoch = int(state_dict["latest_update_epoch"])
        self._scheduler_state = state_dict["scheduler_state"]
        average = state_dict["average_model_state"]
        self._average = None if average is None else dict(average)

    # ------------------------------------------------------------------ the averaging
    def _start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start averaging: SWALR replaces the module's scheduler; the average and its count are made (or moved)."""
        self._initialized = True
        device = self._device or _module_device(module)
        if self._average is None:
            self._average = {name: _local(p).detach().to(device, copy=True) for name, p in module.named_parameters()}
        else:
            self._average = {name: tensor.to(device) for name, tensor in self._average.items()}
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(
            optimizer,
            swa_lr=self._swa_lrs,  # type: ignore[arg-type]
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,
            last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1,
        )
        if self._scheduler_state is None and trainer.current_epoch != self.swa_start:
            rank_zero_warn(
                f"StochasticWeightAveraging starts at epoch {trainer.current_epoch}, after swa_epoch_start, without a"
                " checkpoint of its averaging: the average holds the weights from this epoch on only."
            )
        self._swap_scheduler(trainer, LRSchedulerConfig(self._swa_scheduler))
        if self.n_averaged is None:
            self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long, device=_module_device(module))

    @staticmethod
    def _swap_scheduler(trainer: Trainer, config: LRSchedulerConfig) -> None:
        configs = trainer.lr_scheduler_configs
        if not configs:
            configs.append(config)
            return
        current = configs[0]
        if current.interval != "epoch" or current.frequency != 1:
            rank_zero_warn(
                f"StochasticWeightAveraging replaces {type(current.scheduler).__name__} (interval={current.interval!r},"
                f" frequency={current.frequency}) with SWALR, which steps once per epoch."
            )
        rank_zero_info(f"Swapping scheduler `{type(current.scheduler).__name__}` for `SWALR`")
        configs[0] = config

    def _in_batch_norm_epoch(self, trainer: Trainer) -> bool:
        return self._max_epochs != -1 and self._average is not None and trainer.current_epoch == self.swa_end + 1

    def _restore_max_epochs(self, trainer: Trainer) -> None:
        if self._raised_max_epochs:
            trainer.max_epochs -= 1
            self._raised_max_epochs = False

    @staticmethod
    def update_parameters(
        average: dict[str, Tensor], module: nn.Module, n_averaged: Tensor, avg_fn: AverageFunction
    ) -> None:
        """Add ``module``'s parameters to ``average`` (by name) with ``avg_fn``; count them in ``n_averaged``."""
        for name, parameter in module.named_parameters():
            averaged = average[name]
            current = _local(parameter).detach().to(averaged.device)
            averaged.copy_(current if n_averaged == 0 else avg_fn(averaged, current, n_averaged.to(averaged.device)))
        n_averaged += 1

    @staticmethod
    def avg_fn(averaged_model_parameter: Tensor, model_parameter: Tensor, num_averaged: Tensor) -> Tensor:
        """The equally weighted running mean."""
        return averaged_model_parameter + (model_parameter - averaged_model_parameter) / (num_averaged + 1)

    @staticmethod
    def transfer_weights(average: dict[str, Tensor], module: nn.Module) -> None:
        """Copy the averaged parameters into ``module``."""
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                local = _local(parameter)
                local.copy_(average[name].to(local.device))

    def reset_batch_norm_and_save_state(self, module: nn.Module) -> None:
        """Zero the batch-norm statistics and make them cumulative averages (momentum None), keeping the momenta.

        In place, so that a wrapper holding the buffers (DDP broadcasts them) keeps seeing them.
        """
        self._save_momenta(module)
        for layer in self.momenta:
            if layer.running_mean is not None and layer.running_var is not None:
                layer.running_mean.zero_()
                layer.running_var.fill_(1.0)
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.zero_()

    def _save_momenta(self, module: nn.Module) -> None:
        self.momenta = {}
        for layer in module.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                self.momenta[layer] = layer.momentum
                layer.momentum = None  # type: ignore[assignment]

    def reset_momenta(self) -> None:
        """Give the batch-norm layers their momenta back."""
        for layer, momentum in self.momenta.items():
            layer.momentum = momentum  # type: ignore[assignment]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _copy(tensor: Tensor) -> Tensor:
    # A copy: an asynchronous checkpoint write must not see the next epoch's update of the average.
    return tensor.detach().to("cpu", copy=True)


def _module_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _check_arguments(
    swa_lrs: Any, swa_epoch_start: Any, annealing_epochs: Any, annealing_strategy: Any, avg_fn: Any, device: Any
) -> None:
    if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)):
        raise MisconfigurationError(f"swa_epoch_start={swa_epoch_start!r} must be an int >= 1 or a float in [0, 1].")
    if (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
        isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1
    ):
        raise MisconfigurationError(f"swa_epoch_start={swa_epoch_start!r} must be an int >= 1 or a float in [0, 1].")
    positive_float = lambda value: isinstance(value, float) and value > 0  # noqa: E731
    if not (positive_float(swa_lrs) or (isinstance(swa_lrs, list) and all(positive_float(lr) for lr in swa_lrs))):
        raise MisconfigurationError(f"swa_lrs={swa_lrs!r} must be a positive float or a list of positive floats.")
    if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) or annealing_epochs < 0:
        raise MisconfigurationError(f"annealing_epochs={annealing_epochs!r} must be an int >= 0.")
    if annealing_strategy not in ("cos", "linear"):
        raise MisconfigurationError(f"annealing_strategy={annealing_strategy!r} must be 'cos' or 'linear'.")
    if avg_fn is not None and not callable(avg_fn):
        raise MisconfigurationError(f"avg_fn={avg_fn!r} must be callable: avg_fn(averaged, current, num_averaged).")
    if device is not None and not isinstance(device, (torch.device, str)):
        raise MisconfigurationError(f"device={device!r} must be a torch.device, a str or None.")


__all__ = ["StochasticWeightAveraging"]
