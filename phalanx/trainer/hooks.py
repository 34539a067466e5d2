"""Calling hooks on the TrainingModule, the DataModule and the callbacks, paying only for overridden ones."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from phalanx.callbacks.callback import Callback
from phalanx.module import TrainingModule

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


def _overrides(obj: object, base: type, name: str) -> bool:
    if callable(getattr(obj, "__dict__", {}).get(name)):
        return True  # assigned on the instance (``model.on_train_epoch_end = fn``), as Lightning users do
    method = getattr(type(obj), name, None)
    return method is not None and method is not getattr(base, name, None)


class HookTable:
    """For each hook name, the tuple of bound callables to run, built once per run.

    The module's hook runs before the callbacks' so that metrics it logs in an epoch-end hook are visible to
    monitoring callbacks (ModelCheckpoint, EarlyStopping), which are ordered last.
    """

    def __init__(self) -> None:
        self._table: dict[str, tuple[Callable[..., Any], ...]] = {}

    def build(self, trainer: Trainer, module: TrainingModule, callbacks: list[Callback]) -> None:
        """Collect the overridden hooks of ``module`` and ``callbacks``."""
        table: dict[str, list[Callable[..., Any]]] = {}
        for name in SHARED_HOOKS + CALLBACK_ONLY_HOOKS:
            entries: list[Callable[..., Any]] = []
            if name in SHARED_HOOKS and _overrides(module, TrainingModule, name):
                entries.append(_with_fx_name(module, name))
            for callback in callbacks:
                if _overrides(callback, Callback, name):
                    entries.append(partial(getattr(callback, name), trainer, module))
            table[name] = entries
        self._table = {name: tuple(entries) for name, entries in table.items()}

    def __getitem__(self, name: str) -> tuple[Callable[..., Any], ...]:
        return self._table.get(name, ())

    def call(self, name: str, *args: Any) -> None:
        """Run every registered callable for ``name``."""
        for hook in self._table.get(name, ()):
            hook(*args)


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
        if publishes_epoch_metrics and trainer is not None and trainer._results is not None:
            # What the module logged at epoch end must be visible to the monitoring callbacks called next.
            trainer._publish_epoch_metrics(trainer._results)
        return result

    return call_module_hook
