"""LambdaCallback: each function given runs as the hook of its name, as many times as Lightning's LambdaCallback runs
it for the same project (fit with a sanity check and a checkpoint per epoch), with the hook's arguments."""

from __future__ import annotations

import inspect

import callback_project as project
import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import Callback, LambdaCallback


def test_the_hooks_run_as_often_as_lightnings(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    theirs = project.run("lightning", "lambda", tmp_path / "lightning")
    ours = project.run("phalanx", "lambda", tmp_path / "phalanx")
    assert ours["hooks"] == theirs["hooks"]
    assert ours["hooks"]["on_train_batch_end"] == 30 and ours["hooks"]["on_sanity_check_start"] == 1


def test_with_the_trainers_defaults_each_hook_gets_its_arguments(tmp_path):
    seen = {}
    callback = LambdaCallback(
        setup=lambda trainer, module, stage: seen.setdefault("setup", (trainer, module, stage)),
        on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: seen.setdefault("batch", batch_idx),
        on_save_checkpoint=lambda trainer, module, checkpoint: seen.setdefault("save", checkpoint["global_step"]),
        on_exception=lambda trainer, module, exception: seen.setdefault("exception", exception),
    )
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[callback])
    model = Regressor()
    trainer.fit(model, *loaders())
    assert seen["setup"] == (trainer, model, "fit")
    assert seen["batch"] == 0 and seen["save"] == 8 and "exception" not in seen


def test_it_takes_every_callback_hook_and_refuses_what_is_not_callable():
    hooks = {name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")}
    assert set(inspect.signature(LambdaCallback).parameters) == hooks
    with pytest.raises(TypeError, match=r"LambdaCallback\(on_fit_start=...\) must be a function"):
        LambdaCallback(on_fit_start="print")


def test_an_exception_reaches_on_exception():
    caught = []

    class Failing(Regressor):
        def training_step(self, batch, batch_idx):
            raise KeyError("boom")

    trainer = quiet_trainer(max_epochs=1, callbacks=[LambdaCallback(on_exception=lambda t, m, e: caught.append(e))])
    with pytest.raises(KeyError):
        trainer.fit(Failing(), *loaders())
    assert isinstance(caught[0], KeyError)
