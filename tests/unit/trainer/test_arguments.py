"""Argument resolution (phalanx.trainer.arguments) without a Trainer: defaults, the modes that override other
arguments, and a refused Trainer leaving torch's process-wide switches alone."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import fields

import pytest
import torch

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, TQDMProgressBar
from phalanx.loggers import CSVLogger
from phalanx.profilers import PassThroughProfiler
from phalanx.trainer import Preemption
from phalanx.trainer.arguments import STRATEGY_ARGUMENTS, TrainerSettings, apply_process_switches, resolve_arguments
from phalanx.utilities.enums import GradClipAlgorithmType

_PARAMETERS = inspect.signature(phalanx.Trainer.__init__).parameters
DEFAULTS = {name: p.default for name, p in _PARAMETERS.items() if name != "self"}


def _resolve(tmp_path, **arguments) -> TrainerSettings:
    return resolve_arguments({**DEFAULTS, "default_root_dir": tmp_path, **arguments})


# (arguments, expected settings: only the fields named are checked)
RESOLVED = [
    (
        {},
        {
            "max_epochs": 1000,
            "min_epochs": 0,
            "max_steps": -1,
            "min_steps": 0,
            "max_time": None,
            "num_sanity_val_steps": 2,
            "log_every_n_steps": 50,
            "limit_train_batches": 1.0,
            "limit_predict_batches": 1.0,
            "val_check_interval": 1.0,
            "gradient_clip_algorithm": None,
            "fast_dev_run": False,
            "overfit_batches": 0.0,
        },
    ),
    ({"max_steps": 10}, {"max_epochs": -1, "max_steps": 10}),
    ({"max_time": {"minutes": 2}}, {"max_epochs": -1, "max_time": 120.0}),
    ({"max_epochs": 3, "max_time": "00:00:01:00"}, {"max_epochs": 3, "max_time": 60.0}),
    (
        {"fast_dev_run": True, "max_time": {"hours": 1}, "limit_val_batches": 0.5, "val_check_interval": 3},
        {
            "fast_dev_run": 1,
            "limit_train_batches": 1,
            "limit_val_batches": 1,
            "limit_test_batches": 1,
            "limit_predict_batches": 1,
            "max_steps": 1,
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "val_check_interval": 1.0,
            "max_time": None,
            "loggers": [],
        },
    ),
    ({"fast_dev_run": 0}, {"fast_dev_run": False, "max_steps": -1}),
    ({"fast_dev_run": 3, "overfit_batches": 2}, {"limit_train_batches": 2, "limit_val_batches": 2, "max_steps": 3}),
    ({"overfit_batches": 0.25, "limit_test_batches": 4}, {"limit_train_batches": 0.25, "limit_test_batches": 4}),
    ({"barebones": True}, {"log_every_n_steps": 0, "num_sanity_val_steps": 0, "loggers": [], "callbacks": []}),
    ({"logger": False, "enable_checkpointing": False}, {"loggers": []}),
    ({"gradient_clip_val": 0.5}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": None}),
    ({"gradient_clip_algorithm": "value"}, {"gradient_clip_algorithm": GradClipAlgorithmType.VALUE}),
    ({"gradient_clip_algorithm": GradClipAlgorithmType.NORM}, {"gradient_clip_algorithm": "norm"}),
    ({"preemption": False}, {"preemption": None}),
    ({"val_check_interval": 7, "check_val_every_n_epoch": None}, {"val_check_interval": 7}),
]


@pytest.mark.parametrize(("arguments", "expected"), RESOLVED, ids=[repr(a)[:60] for a, _ in RESOLVED])
def test_arguments_resolve_to_their_settings(tmp_path, arguments, expected):
    settings = _resolve(tmp_path, **arguments)
    assert {name: getattr(settings, name) for name in expected} == expected


def test_default_callbacks_and_logger_are_built_checkpointing_last(tmp_path):
    stop = EarlyStopping(monitor="loss")
    settings = _resolve(tmp_path, callbacks=[ModelCheckpoint(), stop])
    assert [type(cb) for cb in settings.callbacks] == [EarlyStopping, TQDMProgressBar, ModelSummary, ModelCheckpoint]
    assert settings.callbacks[0] is stop
    assert [type(logger) for logger in settings.loggers] == [CSVLogger]
    assert settings.default_root_dir == str(tmp_path)


def test_a_preemption_instance_is_kept_and_true_makes_one(tmp_path):
    mine = Preemption(check_every_n_steps=3)
    assert _resolve(tmp_path, preemption=mine).preemption is mine
    assert isinstance(_resolve(tmp_path, preemption=True).preemption, Preemption)


def test_every_trainer_argument_is_resolved_or_builds_the_strategy(tmp_path):
    # Resolution reads every argument it is given by name: drop any one but the strategy's and it must notice.
    assert set(STRATEGY_ARGUMENTS) <= set(DEFAULTS)
    for name in DEFAULTS:
        arguments = {**DEFAULTS, "default_root_dir": tmp_path}
        del arguments[name]
        if name in STRATEGY_ARGUMENTS and name != "sync_batchnorm":
            resolve_arguments(arguments)
        else:
            with pytest.raises(KeyError, match=name):
                resolve_arguments(arguments)


def test_each_setting_is_the_trainer_attribute_of_its_name(tmp_path):
    trainer = phalanx.Trainer(
        default_root_dir=tmp_path, max_steps=4, limit_val_batches=2, gradient_clip_val=1.0, enable_progress_bar=False
    )
    settings = _resolve(tmp_path, max_steps=4, limit_val_batches=2, gradient_clip_val=1.0, enable_progress_bar=False)
    attributes = settings.trainer_attributes()
    assert set(attributes) == {f.name for f in fields(TrainerSettings)} - {"max_time"} | {"_max_time"}
    for name, value in attributes.items():
        if name in ("loggers", "callbacks"):  # built anew: the same kinds, in the same order
            assert [type(item) for item in getattr(trainer, name)] == [type(item) for item in value], name
        elif name == "preemption":
            assert type(trainer.preemption) is type(value) is Preemption
        elif name == "profiler":  # made anew: a PassThroughProfiler for None
            assert type(trainer.profiler) is type(value) is PassThroughProfiler
        else:
            assert getattr(trainer, name) == value, name


def test_resolution_changes_no_process_wide_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    before = torch.are_deterministic_algorithms_enabled()
    settings = _resolve(tmp_path, deterministic=True, benchmark=True)
    assert settings.deterministic is True
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch.backends.cudnn.benchmark is False


# Arguments refused late in the constructor (after the flags are checked): the switches must still be untouched.
LATE_REFUSALS = [
    ({"callbacks": "early_stopping"}, TypeError, "callbacks="),
    ({"logger": "csv"}, TypeError, "logger="),
    ({"preemption": "yes"}, TypeError, "preemption="),
    ({"enable_checkpointing": False, "callbacks": [ModelCheckpoint()]}, ValueError, "enable_checkpointing=False"),
    ({"strategy": "no_such_strategy"}, ValueError, "Unknown strategy"),
    ({"devices": 2, "strategy": "single_device"}, ValueError, "runs one process"),
]


@pytest.mark.parametrize(("arguments", "error", "fragment"), LATE_REFUSALS, ids=[repr(a) for a, _, _ in LATE_REFUSALS])
def test_a_trainer_refused_late_leaves_process_wide_switches_alone(tmp_path, monkeypatch, arguments, error, fragment):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(error, match=fragment):
        phalanx.Trainer(default_root_dir=tmp_path, deterministic=True, benchmark=True, **arguments)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.deterministic is False


@pytest.mark.parametrize(
    ("deterministic", "benchmark", "initial_benchmark", "expected", "warns"),
    [
        (True, None, True, (True, False, True, True), False),
        ("warn", False, True, (True, True, True, False), False),
        (None, True, False, (False, False, False, True), False),
        (False, None, False, (False, False, False, False), False),
        (True, True, False, (True, False, True, True), True),
    ],
)
def test_process_switches(monkeypatch, deterministic, benchmark, initial_benchmark, expected, warns):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", initial_benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(False)  # the autouse fixture restores the test session's setting
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_process_switches(deterministic=deterministic, benchmark=benchmark)
    observed = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    assert observed == expected
    assert any("against deterministic=True" in str(w.message) for w in caught) == warns
