"""Every Trainer argument of Lightning 2.x is accepted; the ones phalanx has no integration for fail at construction
with what to do instead; min_steps holds a stop request back as in Lightning."""

from __future__ import annotations

import inspect
import warnings

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx

# Lightning 2.5's Trainer signature (keyword-only), from its API reference.
LIGHTNING_TRAINER_ARGUMENTS = (
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run",
    "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
    "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval", "check_val_every_n_epoch",
    "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "deterministic", "benchmark",
    "inference_mode", "use_distributed_sampler", "profiler", "detect_anomaly", "barebones", "plugins", "sync_batchnorm",
    "reload_dataloaders_every_n_epochs", "default_root_dir", "model_registry",
)  # fmt: skip


def test_every_lightning_trainer_argument_is_a_keyword_of_ours():
    parameters = inspect.signature(phalanx.Trainer).parameters
    missing = [name for name in LIGHTNING_TRAINER_ARGUMENTS if name not in parameters]
    assert not missing
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in LIGHTNING_TRAINER_ARGUMENTS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_registry": "my-model"}, r"model_registry='my-model' is not supported: .*no model registry"),
    ],
)
def test_arguments_without_an_integration_are_refused_unless_none(kwargs, message):
    with pytest.raises(ValueError, match=message):
        phalanx.Trainer(logger=False, **kwargs)


def test_their_default_none_is_accepted():
    trainer = phalanx.Trainer(logger=False, profiler=None, model_registry=None, min_steps=None)
    assert trainer.min_steps == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"min_steps": -1}, ValueError, "min_steps=-1"),
        ({"min_steps": 1.5}, ValueError, "min_steps=1.5"),
        ({"min_steps": 6, "max_steps": 5}, ValueError, "min_steps=6 is more than max_steps=5"),
    ],
)
def test_bad_min_steps_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        phalanx.Trainer(logger=False, **kwargs)


class StopAtOnce(phalanx.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.should_stop = True


@pytest.mark.parametrize(
    ("min_steps", "min_epochs", "expected_steps"), [(None, None, 1), (11, None, 11), (3, 2, 16), (20, 1, 20)]
)
def test_a_stop_request_waits_for_min_steps_and_min_epochs(min_steps, min_epochs, expected_steps):
    train, _ = loaders(n=64, batch_size=8)  # 8 batches an epoch
    trainer = quiet_trainer(max_epochs=10, min_steps=min_steps, min_epochs=min_epochs, callbacks=[StopAtOnce()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), train)
    assert trainer.global_step == expected_steps
    held_back = [w for w in caught if "trainer.should_stop was set" in str(w.message)]
    assert len(held_back) == (0 if expected_steps == 1 else 1)  # said once, not every batch


def test_max_steps_still_wins_over_min_steps():
    train, _ = loaders(n=64, batch_size=8)
    trainer = quiet_trainer(max_steps=4, min_steps=4, callbacks=[StopAtOnce()])
    trainer.fit(Regressor(), train)
    assert trainer.global_step == 4


def test_a_lightning_attribute_name_says_what_to_use():
    trainer = phalanx.Trainer(logger=False)
    with pytest.raises(AttributeError, match=r"Lightning's trainer.lightning_module is trainer.module in phalanx"):
        trainer.lightning_module  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'Trainer' object has no attribute 'no_such_thing'$"):
        trainer.no_such_thing  # noqa: B018
    assert not hasattr(trainer, "lightning_module")
    assert trainer.max_epochs == 1000  # normal lookups are untouched
