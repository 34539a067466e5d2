"""The learning-rate sweep behind ``Tuner.lr_find`` and ``LearningRateFinder``: short training at rising rates."""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from phalanx.callbacks.callback import Callback

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.strategies.strategy import Strategy
    from phalanx.trainer.trainer import Trainer

log = logging.getLogger(__name__)

MODES = ("exponential", "linear")
LR_ATTRIBUTES = ("lr", "learning_rate")


def find_lr_attribute(module: Any, attr_name: str = "") -> str:
    """The name of ``module``'s learning-rate attribute (on it or in hparams): ``attr_name``, lr or learning_rate."""
    if attr_name:
        if not _has_attr(module, attr_name):
            raise AttributeError(
                f"The learning-rate attribute {attr_name!r} is neither an attribute of the model nor in its hparams."
            )
        return attr_name
    for name in LR_ATTRIBUTES:
        if _has_attr(module, name):
            return name
    raise AttributeError(
        f"The learning rate finder needs the model or its hparams to have one of {LR_ATTRIBUTES}; "
        "name another attribute with lr_find(attr_name=...)."
    )


def _has_attr(module: Any, name: str) -> bool:
    hparams = getattr(module, "hparams", None)
    return hasattr(module, name) or (hparams is not None and name in hparams)


def _set_attr(module: Any, name: str, value: float) -> None:
    hparams = getattr(module, "hparams", None)
    if hparams is not None and name in hparams:
        hparams[name] = value
    if hasattr(module, name) or hparams is None or name not in hparams:
        setattr(module, name, value)


def sweep_lr(step: int, mode: str, min_lr: float, max_lr: float, num_training: int) -> float:
    """The learning rate of the sweep's optimizer step ``step`` (from 0), spaced as Lightning 2.6 spaces it."""
    if step == 0:
        return min_lr
    fraction = (step + 1) / num_training
    if mode == "linear":
        return min_lr + fraction * (max_lr - min_lr)
    return float(min_lr * (max_lr / min_lr) ** fraction)


class LRFinderResult:
    """What an LR sweep found: ``results`` ({"lr": [...], "loss": [...]}, smoothed), ``suggestion()``, ``plot()``.

    Args:
        mode: ``"exponential"`` or ``"linear"``, how the rate rose from ``lr_min`` to ``lr_max``.
        lr_min: The first rate.
        lr_max: The last rate.
        num_training: The number of steps the sweep was allowed.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        self.mode = mode
        self.lr_min = lr_min
        self.lr_max = lr_max
        self.num_training = num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate where the loss falls fastest (steepest negative slope), ``skip_begin``/``skip_end`` points left out.

        None (with an error logged) when fewer than two finite losses remain.
        """
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            log.error("Too few points to suggest a learning rate: raise num_training or give more training batches.")
            self._optimal_idx = None
            return None
        steepest = int(torch.argmin(torch.gradient(losses, spacing=[lrs])[0]).item())
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[steepest].item())
        return self.results["lr"][self._optimal_idx]

    def plot(
        self, suggest: bool = False, show: bool = False, ax: Any = None, path: str | os.PathLike | None = None
    ) -> Any:
        """Draw loss against rate (a log axis for an exponential sweep) and return the figure; needs matplotlib.

        ``suggest`` marks the suggestion in red, ``show`` shows the figure, ``path`` saves it to that file.
        """
        try:
            import matplotlib.pyplot as plt  # optional dependency, and slow to import
        except ImportError as error:
            raise ImportError("LRFinderResult.plot needs matplotlib: pip install matplotlib.") from error
        fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx is not None:
            index = self._optimal_idx
            ax.plot(self.results["lr"][index], self.results["loss"][index], markersize=10, marker="o", color="red")
        if path is not None:
            fig.savefig(os.fspath(path))
        if show:
            plt.show()
        return fig


class _SweepCallback(Callback):
    """Sets each step's rate, records the smoothed loss and stops when it diverges (as Lightning's _LRCallback)."""

    def __init__(self, result: LRFinderResult, early_stop_threshold: float | None, beta: float = 0.98) -> None:
        self.result = result
        self.early_stop_threshold = early_stop_threshold
        self.beta = beta
        self.avg_loss = 0.0
        self.best_loss = 0.0

    def _steps_batch(self, trainer: Trainer, batch_idx: int) -> bool:
        return (batch_idx + 1) % trainer.accumulate_grad_batches == 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        result = self.result
        lr = sweep_lr(trainer.global_step, result.mode, result.lr_min, result.lr_max, result.num_training)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr
        if self._steps_batch(trainer, batch_idx):
            result.results["lr"].append(lr)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._steps_batch(trainer, batch_idx):
            return
        loss = outputs if isinstance(outputs, torch.Tensor) else (outputs or {}).get("loss")
        diverged = False
        if loss is None:  # a skipped step: NaN keeps lr and loss aligned and is left out of the suggestion
            self.result.results["loss"].append(float("nan"))
        else:
            step = trainer.global_step
            # Lightning's step output holds the loss divided by the accumulated batches; the curve is of that loss.
            current = float(loss.item()) / trainer.accumulate_grad_batches
            self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current
            smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
            threshold = self.early_stop_threshold
            diverged = threshold is not None and step > 1 and smoothed > threshold * self.best_loss
            if smoothed < self.best_loss or step == 1:
                self.best_loss = smoothed
            self.result.results["loss"].append(smoothed)
        # Each rank sees its own losses: all stop at the step where any diverged, or the others would wait for it.
        if trainer.strategy.reduce_boolean_decision(diverged, all=False):
            trainer.should_stop = True


def check_sweep_arguments(min_lr: float, max_lr: float, num_training: int, mode: str) -> None:
    """Raise a ValueError for a sweep that cannot run."""
    if mode not in MODES:
        raise ValueError(f"lr_find's mode={mode!r} is not supported; choose one of {MODES}.")
    if not 0 < min_lr < max_lr:
        raise ValueError(f"lr_find needs 0 < min_lr < max_lr; got min_lr={min_lr} and max_lr={max_lr}.")
    if num_training < 1:
        raise ValueError(f"lr_find's num_training must be a positive number of steps; got {num_training}.")


def run_sweep(
    trainer: Trainer,
    module: TrainingModule,
    result: LRFinderResult,
    early_stop_threshold: float | None,
    fit_kwargs: dict[str, Any],
) -> None:
    """Train a copy of ``module`` for the sweep on a quiet Trainer like ``trainer`` (same accelerator and precision).

    The copy takes every step, so ``module``, ``trainer`` (its counters, loggers, checkpoints, optimizers) and the
    default root directory are left as they were.
    """
    twin = detached_copy(module, trainer)
    original = type(twin).configure_optimizers
    twin.configure_optimizers = lambda: _single_optimizer(original(twin), result.lr_min)  # type: ignore[method-assign]
    quiet = quiet_trainer(
        trainer,
        "learning rate finder",
        max_epochs=trainer.max_epochs,
        max_steps=result.num_training,
        limit_train_batches=trainer.limit_train_batches,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        callbacks=[_SweepCallback(result, early_stop_threshold)],
    )
    quiet.fit(twin, **fit_kwargs)
    # As Lightning: every rank recorded its own losses; rank 0's curve (and so its suggestion) is every rank's.
    result.results = quiet.strategy.broadcast(result.results)
    if quiet.global_step < result.num_training:
        log.info(f"The learning rate finder stopped after {quiet.global_step} steps: the loss diverged.")


def tuning_strategy(trainer: Trainer, tool: str) -> Strategy | None:
    """The strategy of ``tool``'s short fits: None on one process (a one-device Trainer runs them), else the run's
    strategy's twin (``Strategy.twin_for_tuning``); a RuntimeError naming the strategy where it has none."""
    if trainer.world_size == 1:
        return None
    twin = trainer.strategy.twin_for_tuning()
    if twin is None:
        name = type(trainer.strategy).__name__
        raise RuntimeError(
            f"The {tool} does not run on {name} with {trainer.world_size} processes: its short fits train a copy of "
            "the model in these processes, which only DDP started by re-running the script supports (strategy='ddp', "
            "or torchrun/SLURM). Tune with strategy='ddp' or on one device, then pass the value found to this run."
        )
    return twin


def quiet_trainer(trainer: Trainer, tool: str, **settings: Any) -> Trainer:
    """A Trainer like ``trainer`` (accelerator, precision, processes) with ``settings`` and no logger, checkpoints,
    progress bar, model summary or validation, for ``tool``'s short fits; refused as ``tuning_strategy`` says."""
    twin = tuning_strategy(trainer, tool)
    layout: dict[str, Any] = {"devices": 1}
    if twin is not None:
        layout = {"strategy": twin, "devices": len(twin.parallel_devices or ()), "num_nodes": trainer.num_nodes}
    return type(trainer)(
        accelerator=trainer.strategy.accelerator or "auto",
        precision=trainer.precision,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=trainer.default_root_dir,
        preemption=False,
        use_distributed_sampler=trainer.use_distributed_sampler,
        **layout,
        **settings,
    )


def detached_copy(module: Any, trainer: Trainer) -> Any:
    """A deep copy of ``module`` without its links to ``trainer`` and its strategy, for a quiet Trainer to train."""
    links = {name: getattr(module, name, None) for name in ("_trainer", "_strategy")}
    twin = copy.deepcopy(module, memo={id(trainer): None, **{id(link): None for link in links.values()}})
    for name in links:
        setattr(twin, name, None)
    return twin


def _single_optimizer(configured: Any, min_lr: float) -> torch.optim.Optimizer:
    # The sweep drives the rate itself: the user's schedulers are left out, as Lightning leaves them out.
    optimizers = _optimizers_of(configured)
    if len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers; the learning rate finder needs exactly one."
        )
    for group in optimizers[0].param_groups:
        group["lr"] = min_lr
        group["initial_lr"] = min_lr
    return optimizers[0]


def _optimizers_of(configured: Any) -> list[Any]:
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return [configured["optimizer"]]
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):
            return list(configured[0])
        return [item["optimizer"] if isinstance(item, dict) else item for item in configured]
    return []


def update_lr(trainer: Trainer, module: Any, attr_name: str, result: LRFinderResult) -> None:
    """Set ``module``'s rate attribute (and a live optimizer's rates) to the sweep's suggestion, if it has one."""
    lr = result.suggestion()
    if lr is None:
        return
    _set_attr(module, attr_name, lr)
    for optimizer in trainer.optimizers if trainer.strategy.module is not None else []:
        for group in optimizer.param_groups:
            group["lr"] = lr
    log.info(f"Learning rate set to {lr}")
