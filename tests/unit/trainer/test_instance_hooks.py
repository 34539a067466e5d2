"""Hooks assigned on an instance run like overridden ones (``model.on_train_epoch_end = fn``)."""

from __future__ import annotations

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx

MODULE_HOOKS = [
    ("on_train_epoch_end", ()),
    ("on_train_batch_end", ("outputs", "batch", "batch_idx")),
    ("on_fit_start", ()),
    ("on_validation_epoch_end", ()),
]


@pytest.mark.parametrize(("name", "arguments"), MODULE_HOOKS)
def test_a_hook_assigned_on_the_module_runs(name, arguments):
    calls = []
    model = Regressor()
    setattr(model, name, lambda *args: calls.append(len(args)))
    quiet_trainer(max_epochs=2, num_sanity_val_steps=0).fit(model, *loaders(n=16))
    assert calls and set(calls) == {len(arguments)}


@pytest.mark.parametrize(("name", "arguments"), MODULE_HOOKS)
def test_a_hook_assigned_on_a_callback_runs_with_trainer_and_module(name, arguments):
    calls = []
    callback = phalanx.Callback()
    setattr(
        callback,
        name,
        lambda trainer, module, *args: calls.append((trainer.__class__.__name__, type(module).__name__, len(args))),
    )
    quiet_trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=[callback]).fit(Regressor(), *loaders(n=16))
    assert calls and set(calls) == {("Trainer", "Regressor", len(arguments))}


def test_a_non_callable_attribute_named_like_a_hook_is_not_called():
    model = Regressor()
    model.__dict__["on_train_epoch_end"] = None  # not a function: nothing to call, nothing to fail
    quiet_trainer(max_epochs=1, num_sanity_val_steps=0).fit(model, *loaders(n=16))
