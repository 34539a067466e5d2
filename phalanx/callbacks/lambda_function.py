"""LambdaCallback: a callback made on the spot from functions, one per hook (Lightning's ``LambdaCallback``)."""

from __future__ import annotations

from typing import Callable

from phalanx.callbacks.callback import Callback

_Hook = Callable[..., object]


class LambdaCallback(Callback):
    """A callback whose hooks are the functions given by name: ``LambdaCallback(on_fit_start=lambda trainer, module:
    print("start"))``. Each function receives what the hook of that name receives (the Trainer and the module first);
    hooks not given do nothing.
    """

    def __init__(
        self,
        setup: _Hook | None = None,
        teardown: _Hook | None = None,
        on_fit_start: _Hook | None = None,
        on_fit_end: _Hook | None = None,
        on_sanity_check_start: _Hook | None = None,
        on_sanity_check_end: _Hook | None = None,
        on_train_batch_start: _Hook | None = None,
        on_train_batch_end: _Hook | None = None,
        on_train_epoch_start: _Hook | None = None,
        on_train_epoch_end: _Hook | None = None,
        on_validation_epoch_start: _Hook | None = None,
        on_validation_epoch_end: _Hook | None = None,
        on_test_epoch_start: _Hook | None = None,
        on_test_epoch_end: _Hook | None = None,
        on_validation_batch_start: _Hook | None = None,
        on_validation_batch_end: _Hook | None = None,
        on_test_batch_start: _Hook | None = None,
        on_test_batch_end: _Hook | None = None,
        on_train_start: _Hook | None = None,
        on_train_end: _Hook | None = None,
        on_validation_start: _Hook | None = None,
        on_validation_end: _Hook | None = None,
        on_test_start: _Hook | None = None,
        on_test_end: _Hook | None = None,
        on_exception: _Hook | None = None,
        on_save_checkpoint: _Hook | None = None,
        on_load_checkpoint: _Hook | None = None,
        on_before_backward: _Hook | None = None,
        on_after_backward: _Hook | None = None,
        on_before_optimizer_step: _Hook | None = None,
        on_before_zero_grad: _Hook | None = None,
        on_predict_start: _Hook | None = None,
        on_predict_end: _Hook | None = None,
        on_predict_batch_start: _Hook | None = None,
        on_predict_batch_end: _Hook | None = None,
        on_predict_epoch_start: _Hook | None = None,
        on_predict_epoch_end: _Hook | None = None,
    ) -> None:
        for name, function in dict(locals()).items():
            if name in ("self", "__class__") or function is None:
                continue
            if not callable(function):
                raise TypeError(
                    f"LambdaCallback({name}=...) must be a function (or another callable), got"
                    f" {type(function).__name__}."
                )
            # An instance attribute: the Trainer calls it as the hook of that name, without binding it.
            setattr(self, name, function)


__all__ = ["LambdaCallback"]
