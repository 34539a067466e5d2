"""An ``on_*`` method phalanx never calls (a typo, a hook of another kind, a removed Lightning hook) is warned about
once."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

import phalanx
from phalanx.trainer.hooks import KNOWN_HOOKS

MARKER = "looks like a hook"


def _loader() -> DataLoader:
    return DataLoader(regression_data(8), batch_size=8)


class Data(phalanx.DataModule):
    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader()

    def test_dataloader(self):
        return _loader()

    def predict_dataloader(self):
        return _loader()


def _hook_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if MARKER in str(w.message)]


def _with_method(base: type, name: str, on_instance: bool) -> Any:
    def method(self, *args):
        return None

    if on_instance:
        obj = base()
        obj.__dict__[name] = lambda *args: None
        return obj
    return type(f"My{base.__name__}", (base,), {name: method})()


UNKNOWN = [
    # (owner, method name, what the warning must say)
    ("module", "on_train_epoch_ends", "did you mean on_train_epoch_end?"),
    ("module", "on_validaton_epoch_end", "did you mean on_validation_epoch_end?"),
    ("module", "on_sanity_check_start", ": it is a Callback hook, not called on a TrainingModule."),
    (
        "module",
        "on_new_best_model",
        "of that name. If it is not meant as a hook, give it a name that does not start with 'on_'",
    ),
    ("callback", "on_train_batch_ended", "did you mean on_train_batch_end?"),
    ("callback", "on_after_batch_transfer", ": it is a TrainingModule and DataModule hook, not called on a Callback."),
    (
        "callback",
        "on_epoch_end",
        ": Lightning 2 removed it; use on_train_epoch_end, on_validation_epoch_end or on_test_epoch_end.",
    ),
    (
        "callback",
        "on_before_optimizer_setup",
        ": phalanx does not call this Lightning hook; use configure_model or setup",
    ),
    ("datamodule", "on_before_batch_transfers", "did you mean on_before_batch_transfer?"),
]


@pytest.mark.parametrize("on_instance", [False, True], ids=["defined in the class", "assigned on the instance"])
@pytest.mark.parametrize(("owner", "name", "says"), UNKNOWN)
def test_a_method_named_like_an_unknown_hook_is_warned_about_once(tmp_path, owner, name, says, on_instance):
    base = {"module": Regressor, "callback": phalanx.Callback, "datamodule": Data}[owner]
    obj = _with_method(base, name, on_instance)
    model = obj if owner == "module" else Regressor()
    callbacks = [obj] if owner == "callback" else []
    datamodule = obj if owner == "datamodule" else Data()
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, num_sanity_val_steps=0, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=datamodule)
        trainer.validate(model, datamodule=datamodule, verbose=False)
    found = _hook_warnings(caught)
    assert len(found) == 1, found  # once per Trainer, not once per run
    kind = {"module": "TrainingModule", "callback": "Callback", "datamodule": "DataModule"}[owner]
    assert (
        f"{type(obj).__name__}.{name} looks like a hook, but phalanx never calls a {kind} method of that name"
        in found[0]
    )
    assert says in found[0]


def _delegating(base: type, names: frozenset[str]) -> dict[str, Any]:
    """Overrides of every known hook that do what the base class does."""

    def override(name: str) -> Any:
        inherited = getattr(base, name)

        def method(self, *args):
            self.called.add(name)
            return inherited(self, *args)

        return method

    return {name: override(name) for name in names}


def test_no_warning_for_any_hook_phalanx_calls(tmp_path):
    module = type(
        "EveryModuleHook", (Regressor,), _delegating(phalanx.TrainingModule, KNOWN_HOOKS[phalanx.TrainingModule])
    )()
    callback = type(
        "EveryCallbackHook", (phalanx.Callback,), _delegating(phalanx.Callback, KNOWN_HOOKS[phalanx.Callback])
    )()
    data = type("EveryDataHook", (Data,), _delegating(phalanx.DataModule, KNOWN_HOOKS[phalanx.DataModule]))()
    for obj in (module, callback, data):
        obj.called = set()
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=1, callbacks=[callback], enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
        trainer.validate(module, datamodule=data, verbose=False)
        trainer.test(module, datamodule=data, verbose=False)
        trainer.predict(module, datamodule=data)
    assert _hook_warnings(caught) == []
    # The overrides ran: these are hooks the loops call, not names merely tolerated.
    assert {
        "optimizer_step",
        "optimizer_zero_grad",
        "on_validation_model_eval",
        "on_test_model_train",
        "on_predict_model_eval",
        "on_save_checkpoint",
    } <= module.called
    assert {"on_sanity_check_start", "on_train_batch_end", "on_save_checkpoint", "on_predict_end"} <= callback.called
    assert {
        "on_before_batch_transfer",
        "transfer_batch_to_device",
        "on_after_batch_transfer",
        "on_save_checkpoint",
    } <= data.called
