"""Every Trainer argument refuses a bad value at construction, naming the argument, the value and the valid choices."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

import phalanx
from phalanx.accelerators import CPUAccelerator
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.loggers import CSVLogger
from phalanx.plugins import DoublePrecision, TorchCheckpointIO
from phalanx.strategies import DDPStrategy, SingleDeviceStrategy
from phalanx.trainer import Preemption

NAN, INF = math.nan, math.inf

# (argument, bad value, exception type, fragment the message must hold). The argument's name is checked as well.
BAD_ARGUMENTS = [
    # a class where an instance is needed
    ("strategy", DDPStrategy, TypeError, "pass an instance, e.g. DDPStrategy()"),
    ("strategy", SingleDeviceStrategy, TypeError, "or a registered name: ['auto', "),
    ("accelerator", CPUAccelerator, TypeError, "pass an instance, e.g. CPUAccelerator()"),
    ("precision", DoublePrecision, TypeError, "plugins=[DoublePrecision()]"),
    ("precision", DoublePrecision(), TypeError, "plugins=[DoublePrecision()]"),
    (
        "plugins",
        DoublePrecision,
        TypeError,
        "plugins=DoublePrecision is a class, not an instance; pass an instance, e.g. DoublePrecision()",
    ),
    ("plugins", [TorchCheckpointIO], TypeError, "plugins[0]=TorchCheckpointIO is a class"),
    ("callbacks", EarlyStopping, TypeError, "pass an instance, e.g. EarlyStopping()"),
    ("callbacks", [ModelCheckpoint], TypeError, "callbacks[0]=ModelCheckpoint is a class"),
    ("logger", CSVLogger, TypeError, "pass an instance, e.g. CSVLogger(save_dir=...)"),
    ("logger", "csv", TypeError, "logger='csv' (of type str) is not a Logger; pass True, False, a Logger instance"),
    ("logger", [CSVLogger], TypeError, "logger[0]=CSVLogger is a class"),
    ("preemption", Preemption, TypeError, "pass an instance, e.g. Preemption()"),
    # wrong types and values, with the choices
    ("strategy", None, TypeError, "pass a registered name"),
    ("accelerator", None, TypeError, "or an Accelerator instance"),
    ("callbacks", "early_stopping", TypeError, "pass a Callback instance or a list"),
    ("preemption", "yes", TypeError, "pass True, False or a phalanx.trainer.Preemption"),
    ("max_time", {"hour": 1}, ValueError, "unknown key(s) ['hour']; valid keys: ['weeks', 'days', 'hours'"),
    ("max_time", {"hours": -1}, ValueError, "max_time['hours']=-1 must be a finite number >= 0"),
    ("max_time", {"hours": 1, "minutes": -30}, ValueError, "max_time['minutes']=-30"),
    ("max_time", {"hours": "1"}, TypeError, "max_time['hours']='1' must be a number"),
    ("max_time", {"hours": True}, TypeError, "must be a number"),
    ("max_time", {"hours": NAN}, ValueError, "finite"),
    ("max_time", {"days": INF}, ValueError, "finite"),
    ("max_time", {"minutes": 0}, ValueError, "must be a positive duration"),
    ("max_time", {"days": 10**10}, ValueError, "longer than a datetime.timedelta can hold"),
    ("max_time", "1 hour", ValueError, "DD:HH:MM:SS"),
    ("max_time", "00:00:00:00", ValueError, "positive duration"),
    ("max_time", "99999999999:00:00:00", ValueError, "longer than a datetime.timedelta can hold"),
    ("max_time", 3600, TypeError, "max_time=3600 (of type int) is not valid; pass a 'DD:HH:MM:SS' string"),
    ("max_time", timedelta(seconds=-5), ValueError, "positive duration"),
    ("default_root_dir", 3, TypeError, "default_root_dir=3 (of type int) is not valid; pass a path"),
    ("default_root_dir", ["logs"], TypeError, "(of type list)"),
    ("default_root_dir", b"/tmp/logs", TypeError, "(of type bytes)"),
    ("default_root_dir", "", ValueError, "is not a path"),
    ("default_root_dir", "logs\x00", ValueError, "NUL character"),
    ("sync_batchnorm", "False", TypeError, "sync_batchnorm='False' is not valid; pass True or False"),
    ("use_distributed_sampler", 1, TypeError, "pass True or False"),
    ("inference_mode", None, TypeError, "pass True or False"),
    ("detect_anomaly", "yes", TypeError, "pass True or False"),
    ("enable_checkpointing", "no", TypeError, "pass True or False (or None for the default)"),
    ("enable_progress_bar", 0, TypeError, "pass True or False"),
    ("enable_model_summary", [], TypeError, "pass True or False"),
    ("benchmark", "fast", TypeError, "pass True or False"),
    ("deterministic", 1, ValueError, "choose True, False or 'warn' (or None)"),
    ("deterministic", "yes", ValueError, "'warn'"),
    ("nonfinite_loss", "skipp", ValueError, "choose 'warn', 'skip', 'stop', 'raise' or 'ignore'"),
    ("nonfinite_loss", None, ValueError, "choose 'warn'"),
    ("gradient_clip_val", NAN, ValueError, "must be a finite number >= 0"),
    ("gradient_clip_val", INF, ValueError, "finite"),
    ("gradient_clip_val", "1.0", ValueError, "gradient_clip_val='1.0'"),
    ("gradient_clip_algorithm", "l2", ValueError, "choose 'norm' or 'value'"),
    ("val_check_interval", NAN, ValueError, "val_check_interval=nan is not valid; it must be a float in (0.0, 1.0]"),
    ("val_check_interval", INF, ValueError, "(0.0, 1.0]"),
    ("max_steps", -2, ValueError, "max_steps=-2 is not valid; it must be an int >= -1"),
    ("max_epochs", 2.0, ValueError, "an int >= -1 or None"),
    ("min_epochs", -1, ValueError, "min_epochs=-1"),
    ("log_every_n_steps", "10", ValueError, "log_every_n_steps='10'"),
    ("accumulate_grad_batches", 2.0, ValueError, "an int >= 1"),
    ("num_sanity_val_steps", -2, ValueError, "an int >= -1 or None"),
    ("check_val_every_n_epoch", 0, ValueError, "an int >= 1 or None"),
    ("fast_dev_run", 1.5, ValueError, "a bool or an int >= 0"),
    ("num_nodes", True, ValueError, "num_nodes=True"),
    ("limit_train_batches", NAN, ValueError, "[0.0, 1.0]"),
    ("limit_val_batches", "all", TypeError, "number of batches"),
]


@pytest.mark.parametrize(
    ("argument", "value", "error", "fragment"), BAD_ARGUMENTS, ids=[f"{a}={v!r}"[:60] for a, v, _, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_is_refused_with_its_name_value_and_choices(argument, value, error, fragment):
    kwargs = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, argument: value}
    with pytest.raises(error) as raised:
        phalanx.Trainer(**kwargs)
    message = str(raised.value)
    assert fragment in message
    assert argument in message


def test_min_epochs_above_max_epochs_is_refused():
    with pytest.raises(ValueError, match="min_epochs=3 is more than max_epochs=2"):
        phalanx.Trainer(min_epochs=3, max_epochs=2, logger=False)


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_a_default_root_dir_that_cannot_be_a_directory_is_refused(tmp_path, where):
    existing = tmp_path / "notes.txt"
    existing.write_text("not a directory")
    path = existing if where == "file" else existing / "logs"
    with pytest.raises(ValueError, match="is an existing file" if where == "file" else "is below the existing file"):
        phalanx.Trainer(default_root_dir=path)
    assert existing.read_text() == "not a directory"


def test_a_refused_trainer_leaves_process_wide_switches_alone():
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(TypeError, match="default_root_dir"):
        phalanx.Trainer(deterministic=True, default_root_dir=3)
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize("value", [{"hours": 1, "minutes": 30}, {"seconds": 0.5}, "00:01:30:00", timedelta(minutes=5)])
def test_valid_max_time_forms_are_accepted(value):
    trainer = phalanx.Trainer(max_time=value, logger=False)
    assert trainer._max_time > 0
