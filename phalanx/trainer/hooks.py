"""Calling hooks on the TrainingModule, the DataModule and the callbacks, paying only for overridden ones."""

from __future__ import annotations

import difflib
import inspect
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from phalanx.callbacks.callback import Callback
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.model_checkpoint import Checkpoint
from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.strategy import Strategy
from phalanx.trainer.profiling import profiled_hooks, records
from phalanx.trainer.state import TrainerFn
from phalanx.utilities.apply import move_to_device
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

# Hooks that callbacks and the module share; callbacks receive (trainer, module, *args).
SHARED_HOOKS = (
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
    "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_test_batch_start", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
)  # fmt: skip
CALLBACK_ONLY_HOOKS = ("on_sanity_check_start", "on_sanity_check_end")
# Module hooks whose default is what the loops do anyway: the loops call them only when overridden.
MODULE_ONLY_HOOKS = (
    "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad",
    "on_test_model_eval", "on_test_model_train", "on_predict_model_eval", "on_predict_model_train",
    "optimizer_step", "optimizer_zero_grad",
)  # fmt: skip
# Around the move of each batch; a DataModule's override wins over the module's, as in Lightning.
BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
# Called where they happen (checkpoint save and load, a failing run), not through the table.
CHECKPOINT_HOOKS = ("on_save_checkpoint", "on_load_checkpoint")
# Every hook phalanx calls, per kind of object: an ``on_*`` method outside these is never called (and warned about).
KNOWN_HOOKS: dict[type, frozenset[str]] = {
    TrainingModule: frozenset(SHARED_HOOKS + MODULE_ONLY_HOOKS + BATCH_TRANSFER_HOOKS + CHECKPOINT_HOOKS),
    Callback: frozenset(SHARED_HOOKS + CALLBACK_ONLY_HOOKS + CHECKPOINT_HOOKS + ("on_exception",)),
    DataModule: frozenset(BATCH_TRANSFER_HOOKS + CHECKPOINT_HOOKS),
}


def overrides_gradient_clipping(module: TrainingModule) -> bool:
    """Whether ``module`` (its class or the instance) replaces ``configure_gradient_clipping``."""
    return _overrides(module, TrainingModule, "configure_gradient_clipping")


def _overrides(obj: object, base: type, name: str) -> bool:
    if callable(getattr(obj, "__dict__", {}).get(name)):
        return True  # assigned on the instance (``model.on_train_epoch_end = fn``), as Lightning users do
    method = getattr(type(obj), name, None)
    return method is not None and method is not getattr(base, name, None)


def _not_built(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("HookTable.build() must run before the loops move batches.")


# Callbacks that act on a monitored metric: in on_train_epoch_end they run after the module, as in Lightning.
MONITORING_CALLBACKS = (EarlyStopping, Checkpoint)


class HookTable:
    """For each hook name, the tuple of bound callables to run, built once per run.

    As in Lightning, the callbacks' hook runs before the module's, so that what a callback sets up for the module (a
    finetuning schedule, a curriculum) is there when the module's hook runs. One exception, Lightning's too: in
    ``on_train_epoch_end`` the monitoring callbacks (``EarlyStopping``, checkpoint callbacks) run after the module, so
    that they see the metrics it logs there.
    """

    def __init__(self) -> None:
        self._table: dict[str, tuple[Callable[..., Any], ...]] = {}
        #: ``move_batch(batch, dataloader_idx=0)``: the strategy's move, or the batch transfer hooks around it.
        self.move_batch: Callable[..., Any] = _not_built
        #: ``move_train_batch(batch)``: the same, for the fit loop (no dataloader_idx).
        self.move_train_batch: Callable[..., Any] = _not_built
        #: Whether the run's module overrides ``configure_gradient_clipping`` (decided once per run, not per step).
        self.clipping_overridden = False
        self._warned: set[tuple[str, str]] = set()

    def build(self, trainer: Trainer, module: TrainingModule, callbacks: list[Callback]) -> None:
        """Collect the overridden hooks of ``module`` and ``callbacks``; warn about ``on_*`` methods never called."""
        table: dict[str, list[Callable[..., Any]]] = {}
        for name in SHARED_HOOKS + CALLBACK_ONLY_HOOKS:
            overriding = [callback for callback in callbacks if _overrides(callback, Callback, name)]
            split = name == "on_train_epoch_end"
            last = [cb for cb in overriding if split and isinstance(cb, MONITORING_CALLBACKS)]
            entries = [partial(getattr(cb, name), trainer, module) for cb in overriding if cb not in last]
            if name in SHARED_HOOKS and _overrides(module, TrainingModule, name):
                entries.append(_with_fx_name(module, name))
            table[name] = entries + [partial(getattr(cb, name), trainer, module) for cb in last]
        for name in MODULE_ONLY_HOOKS:
            table[name] = [_with_fx_name(module, name)] if _overrides(module, TrainingModule, name) else []
        self._table = {name: tuple(entries) for name, entries in table.items()}
        if records(trainer.profiler):  # only then: the unprofiled loops call the hooks themselves
            self._table = profiled_hooks(self._table, trainer.profiler, module)
        self.move_batch = _batch_mover(trainer.strategy, module, trainer.datamodule, self._warn_once)
        self.move_train_batch = _train_batch_mover(trainer.strategy, self.move_batch)
        self.clipping_overridden = overrides_gradient_clipping(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_step_hooks(module)
        for obj in (module, trainer.datamodule, *callbacks):
            if obj is not None:
                self._warn_unknown_hooks(obj)

    def __getitem__(self, name: str) -> tuple[Callable[..., Any], ...]:
        return self._table.get(name, ())

    def call(self, name: str, *args: Any) -> None:
        """Run every registered callable for ``name``."""
        for hook in self._table.get(name, ()):
            hook(*args)

    def _warn_once(self, owner: object, name: str, message: str) -> None:
        key = (type(owner).__qualname__, name)
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _warn_unknown_hooks(self, obj: object) -> None:
        base = next(kind for kind in KNOWN_HOOKS if isinstance(obj, kind))
        known = KNOWN_HOOKS[base]
        for name in sorted(_hook_like_names(obj, base) - known):
            self._warn_once(obj, name, _unknown_hook_message(obj, base, name))

    def _check_step_hooks(self, module: TrainingModule) -> None:
        overridden = [name for name in ("optimizer_step", "optimizer_zero_grad") if self._table[name]]
        for name in overridden:
            if "optimizer_idx" in inspect.signature(getattr(module, name)).parameters:
                raise MisconfigurationError(
                    f"{type(module).__name__}.{name} takes optimizer_idx, Lightning 1.x's signature. Define"
                    f" {_STEP_SIGNATURES[name]} (Lightning 2.x's); for several optimizers set"
                    " self.automatic_optimization = False and step them in training_step."
                )
            if not module.automatic_optimization:
                self._warn_once(
                    module, name,
                    f"{type(module).__name__} overrides {name}, which the training loop calls only with automatic"
                    f" optimization; with self.automatic_optimization = False it is never called: call"
                    " opt.step() / opt.zero_grad() on self.optimizers() in training_step.",
                )  # fmt: skip


_STEP_SIGNATURES = {
    "optimizer_step": "optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None)",
    "optimizer_zero_grad": "optimizer_zero_grad(self, epoch, batch_idx, optimizer)",
}


def _hook_like_names(obj: object, base: type) -> set[str]:
    """Public ``on_*`` methods defined below ``base`` in ``obj``'s classes, or assigned on ``obj`` itself."""
    names = {name for name, value in getattr(obj, "__dict__", {}).items() if callable(value)}
    for cls in type(obj).__mro__:
        if cls not in base.__mro__:
            names.update(
                name
                for name, value in vars(cls).items()
                if callable(value) or isinstance(value, (staticmethod, classmethod))
            )
    return {name for name in names if name.startswith("on_")}


# Lightning 1.x hooks removed in Lightning 2, which migrating code may still define.
REMOVED_LIGHTNING_HOOKS = {
    "on_epoch_start": "on_train_epoch_start, on_validation_epoch_start or on_test_epoch_start",
    "on_epoch_end": "on_train_epoch_end, on_validation_epoch_end or on_test_epoch_end",
    "on_batch_start": "on_train_batch_start",
    "on_batch_end": "on_train_batch_end",
    "on_pretrain_routine_start": "on_fit_start",
    "on_pretrain_routine_end": "on_fit_start",
    "on_keyboard_interrupt": "on_exception (a Callback hook)",
    "on_configure_sharded_model": "configure_model",
    "on_before_accelerator_backend_setup": "setup",
}
# Lightning 2 hooks phalanx does not call, with what to use instead.
UNCALLED_LIGHTNING_HOOKS = {
    "on_before_optimizer_setup": "configure_model or setup, which run before configure_optimizers"
}


def _unknown_hook_message(obj: object, base: type, name: str) -> str:
    kind = base.__name__
    message = f"{type(obj).__name__}.{name} looks like a hook, but phalanx never calls a {kind} method of that name"
    elsewhere = [other.__name__ for other, names in KNOWN_HOOKS.items() if other is not base and name in names]
    close = difflib.get_close_matches(name, sorted(KNOWN_HOOKS[base]), n=1, cutoff=0.8)  # typos, not any on_ name
    if name in REMOVED_LIGHTNING_HOOKS:
        message += f": Lightning 2 removed it; use {REMOVED_LIGHTNING_HOOKS[name]}."
    elif name in UNCALLED_LIGHTNING_HOOKS:
        message += f": phalanx does not call this Lightning hook; use {UNCALLED_LIGHTNING_HOOKS[name]}."
    elif elsewhere:
        message += f": it is a {' and '.join(elsewhere)} hook, not called on a {kind}."
    elif close:
        message += f": did you mean {close[0]}?"
    else:
        message += "."
    return (
        message
        + " If it is not meant as a hook, give it a name that does not start with 'on_' to silence this warning."
    )


_Warn = Callable[[object, str, str], None]


def _data_hook(
    name: str, module: TrainingModule, datamodule: DataModule | None, warn: _Warn
) -> Callable[..., Any] | None:
    """The override of a batch transfer hook to call: the DataModule's, else the module's, else None."""
    in_module = _overrides(module, TrainingModule, name)
    if datamodule is not None and _overrides(datamodule, DataModule, name):
        if in_module:
            warn(
                datamodule,
                name,
                f"{type(module).__name__} and {type(datamodule).__name__} both override {name}: the DataModule's is"
                " used, as in Lightning.",
            )
        return getattr(datamodule, name)
    return getattr(module, name) if in_module else None


def _train_batch_mover(strategy: Strategy, move_batch: Callable[..., Any]) -> Callable[..., Any]:
    """``move_batch`` for the fit loop: ``move_to_device`` itself where the strategy's move is the base's unchanged
    ``batch_to_device`` (not overridden, nor shadowed by a profiler's timer) and the precision converts no input (two
    calls less per batch)."""
    plain = (
        isinstance(move_batch, partial)
        and getattr(move_batch.func, "__func__", None) is Strategy.batch_to_device
        and type(strategy.precision_plugin).convert_input is Precision.convert_input
    )
    return partial(move_to_device, device=move_batch.keywords["device"]) if plain else move_batch  # type: ignore[attr-defined]


def _batch_mover(
    strategy: Strategy, module: TrainingModule, datamodule: DataModule | None, warn: _Warn
) -> Callable[..., Any]:
    """``move(batch, dataloader_idx=0)``: the strategy's own move unless a batch transfer hook is overridden."""
    before, transfer, after = (_data_hook(name, module, datamodule, warn) for name in BATCH_TRANSFER_HOOKS)
    if before is None and transfer is None and after is None:
        # Nothing overridden: no extra call per batch. The device is read once here, after the strategy set up its
        # environment (a parallel strategy's root_device reads the local rank from the environment at each call).
        return partial(strategy.batch_to_device, device=strategy.root_device)

    def move(batch: Any, dataloader_idx: int = 0) -> Any:
        if before is not None:
            batch = before(batch, dataloader_idx)
        if transfer is None:
            batch = strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)
        else:
            # The user's move replaces the strategy's; the precision's input conversion still applies.
            batch = strategy.precision_plugin.convert_input(transfer(batch, strategy.root_device, dataloader_idx))
        if after is not None:
            batch = after(batch, dataloader_idx)
        return batch

    return move


def _with_fx_name(module: TrainingModule, name: str) -> Callable[..., Any]:
    method = getattr(module, name)
    publishes_epoch_metrics = name.endswith("_epoch_end")

    def call_module_hook(*args: Any) -> Any:
        # self.log inside a hook needs to know where it is called from to pick step/epoch defaults.
        previous = module._current_fx
        module.__dict__["_current_fx"] = name
        try:
            result = method(*args)
        finally:
            module.__dict__["_current_fx"] = previous
        trainer = module._trainer
        if publishes_epoch_metrics and trainer is not None and trainer._run.results is not None:
            # What the module logged at epoch end must be visible to the monitoring callbacks called next.
            trainer._metrics.publish_epoch(trainer._run.results)
        return result

    return call_module_hook
