"""Optimization during ``fit``: the optimizer handle of
``TrainingModule.optimizers()`` and of the ``optimizer_step`` hook, the checks of the optimizers a module configured,
and the stepping of its LR schedulers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor
from torch.optim import Optimizer

from phalanx.trainer.state import TrainerFn, TrainerStatus
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def _no_closure() -> None:
    return None


class ManualOptimizer:
    """Wraps a torch optimizer so that ``step()`` goes through the strategy and precision plugin.

    With manual optimization each ``step()`` counts as a global step; with automatic optimization (the handle given to
    ``TrainingModule.optimizer_step``) the training loop counts its steps, one per stepping batch, as in Lightning.
    """

    def __init__(self, optimizer: Optimizer, trainer: Trainer | None) -> None:
        self.optimizer = optimizer
        self._trainer = trainer
        # Inside the optimizer_step hook: what step() without a closure runs (the loss of the closure already run).
        self._closure_if_none: Callable[[], Any] | None = None

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the optimizer step (closure, loss scaling, clipping, hooks); in manual optimization advance
        ``global_step``."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(
                "This optimizer handle is a copy (pickled or deep-copied) and is detached from the Trainer; call"
                " self.optimizers() in the TrainingModule for a handle that steps."
            )
        if closure is None:
            closure = self.__dict__.get("_closure_if_none") or _no_closure
        module = trainer.strategy.module
        result = trainer.strategy.optimizer_step(self.optimizer, closure, module, **kwargs)
        if module is None or not module.automatic_optimization:
            trainer.fit_loop.global_step += 1
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the handle lacks. While pickle or copy rebuild a handle, "optimizer" itself is not
        # there yet: looking it up through __getattr__ again would recurse forever.
        if name == "optimizer" or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        # The wrapped optimizer travels; the Trainer (threads, files, the process group) does not.
        return {"optimizer": self.optimizer, "_trainer": None, "_closure_if_none": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ManualOptimizer({self.optimizer!r})"


def call_step_hook(
    step_hook: Callable[..., Any],
    handle: ManualOptimizer,
    closure: Callable[[], Any],
    epoch: int,
    batch_idx: int,
    module: Any,
) -> None:
    """Call the module's ``optimizer_step`` override with ``handle``, whose ``step(closure)`` is the strategy's step;
    refuse an override that never ran the closure."""
    runs = 0
    result: Tensor | None = None

    def optimizer_closure() -> Tensor | None:
        nonlocal runs, result
        runs += 1
        result = closure()
        return result

    def closure_already_run() -> Tensor | None:
        # ``optimizer_closure(); optimizer.step()``: the step sees the loss computed (the precision plugin needs it).
        if not runs:
            raise _closure_not_run(module, epoch, batch_idx)
        return result

    handle._closure_if_none = closure_already_run
    try:
        step_hook(epoch, batch_idx, handle, optimizer_closure)
    finally:
        handle._closure_if_none = None
    if not runs:
        raise _closure_not_run(module, epoch, batch_idx)


def _closure_not_run(module: Any, epoch: int, batch_idx: int) -> MisconfigurationError:
    # Without the closure, training_step and backward never run: the batch would be silently skipped.
    return MisconfigurationError(
        f"{type(module).__name__}.optimizer_step did not run the optimizer_closure it was given (epoch {epoch},"
        f" batch_idx {batch_idx}), so training_step and backward never ran. Call"
        " optimizer.step(closure=optimizer_closure), or optimizer_closure() alone to skip the update; if your"
        " optimizer's step() ignores its closure, call optimizer_closure() before it."
    )


class AccumulationSetting:
    """``trainer.accumulate_grad_batches``, which a callback may change during ``fit`` (as Lightning's
    ``GradientAccumulationScheduler`` does): the loss is then divided by the new window, as in Lightning.

    Without ``__get__`` this descriptor leaves reads to the instance's ``__dict__``: the loops read the setting every
    batch at the cost of a plain attribute. A write checks the value and, during ``fit``, sets the loss divisor, so
    the step never reads the setting again to divide.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __set__(self, trainer: Trainer, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{self.name}={value!r} is not valid; it must be an int >= 1.")
        state = trainer.__dict__.get("state")
        fitting = state is not None and state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING
        if fitting and value != trainer.__dict__[self.name]:
            strategy = trainer.strategy
            if strategy.traits.handles_gradient_accumulation:
                raise ValueError(
                    f"trainer.{self.name} cannot change during fit with {type(strategy).__name__}, which fixes its"
                    f" accumulation when it is set up; pass Trainer({self.name}=...) instead."
                )
            if strategy.module is not None and not strategy.module.automatic_optimization and value != 1:
                raise _manual_accumulation_error()
            trainer._run.loss_divisor = value
        trainer.__dict__[self.name] = value


def _manual_accumulation_error() -> ValueError:
    return ValueError(
        "accumulate_grad_batches is for automatic optimization; with manual optimization accumulate in training_step."
    )


def prepare_optimization(trainer: Trainer, module: TrainingModule) -> None:
    """After the strategy's setup: the optimizer handles, the loss divisor and the schedulers of this fit; refuse
    Trainer options the module's kind of optimization cannot honour."""
    strategy = trainer.strategy
    optimizers = strategy.optimizers
    trainer._run.manual_optimizers = [ManualOptimizer(optimizer, trainer) for optimizer in optimizers]
    trainer._run.loss_divisor = (
        trainer.accumulate_grad_batches if not strategy.traits.handles_gradient_accumulation else 1
    )
    if module.automatic_optimization:
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization uses exactly one."
                " For several optimizers (e.g. GANs) set self.automatic_optimization = False and step them in"
                " training_step."
            )
        trainer._run.optimizer = optimizers[0]
    else:
        if trainer.gradient_clip_val:
            raise ValueError(
                "gradient_clip_val is for automatic optimization; with manual optimization call"
                " self.clip_gradients(optimizer, ...) in training_step."
            )
        if trainer.accumulate_grad_batches != 1:
            raise _manual_accumulation_error()
        trainer._run.optimizer = None
    follow_scheduler_changes(trainer)


def follow_scheduler_changes(trainer: Trainer) -> None:
    """Sort ``trainer.lr_scheduler_configs`` into the schedulers the loop steps per optimizer step and per epoch.

    Called when fit prepares its optimizers, after ``on_fit_start`` and after each ``on_train_epoch_start`` (once
    per epoch, off the step's path): a callback may replace or add a scheduler in that list there, as Lightning's
    ``StochasticWeightAveraging`` does. In manual optimization the user steps schedulers: the loop steps none.
    """
    module = trainer.strategy.module
    configs = trainer.strategy.lr_scheduler_configs if module is not None and module.automatic_optimization else []
    trainer._run.step_scheduler_configs = [c for c in configs if c.interval == "step"]
    trainer._run.epoch_scheduler_configs = [c for c in configs if c.interval == "epoch"]


def step_schedulers(trainer: Trainer, interval: str) -> None:
    """Step the LR schedulers of ``interval`` ('step' or 'epoch') that are due at the current step or epoch."""
    configs = trainer._run.step_scheduler_configs if interval == "step" else trainer._run.epoch_scheduler_configs
    counter = trainer.fit_loop.global_step if interval == "step" else trainer.fit_loop.current_epoch + 1
    module = trainer.strategy.module
    assert module is not None
    for config in configs:
        if counter % config.frequency:
            continue
        metric = None
        if config.reduce_on_plateau:
            metric = trainer.callback_metrics.get(config.monitor)
            if metric is None:
                if config.strict:
                    raise ValueError(
                        f"The LR scheduler monitors {config.monitor!r}, which was not logged. Logged metrics:"
                        f" {sorted(trainer.callback_metrics)}. Set 'strict': False to skip the step instead."
                    )
                rank_zero_warn(
                    f"The LR scheduler monitors {config.monitor!r}, which was not logged; its step is skipped."
                )
                continue
        module.lr_scheduler_step(config.scheduler, metric)


__all__ = [
    "AccumulationSetting",
    "ManualOptimizer",
    "call_step_hook",
    "follow_scheduler_changes",
    "prepare_optimization",
    "step_schedulers",
]
