"""Every setting assigned to a Trainer after construction is checked as the constructor checks it (the same error for
the same bad value, the same resolved value for a good one), or refused with the reason when the Trainer used it at
construction only; Lightning's ``trainer.fit_loop.max_epochs = N`` and ``trainer.logger = ...`` are honoured; nothing
of the Trainer can be deleted.

The tables are checked against the Trainer itself: every constructor argument and every setting it holds is in one of
them, and so is every name Lightning 2.6 lets a user assign on its Trainer that phalanx's Trainer also has.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint, TQDMProgressBar
from phalanx.loggers import CSVLogger
from phalanx.trainer.assignment import ASSIGNABLE, READ_ONLY
from phalanx.trainer.preemption import Preemption
from phalanx.trainer.state import RunState
from phalanx.utilities.enums import GradClipAlgorithmType

#: Bad values per assignable setting: each must be refused on assignment as the constructor refuses it.
BAD: dict[str, list[Any]] = {
    "max_epochs": ["5", -2, 1.5, True],
    "min_epochs": ["1", -1, 0.5],
    "max_steps": ["5", -7, 2.0, None],
    "min_steps": ["1", -1],
    "accumulate_grad_batches": [0, "2", 1.0, None],
    "check_val_every_n_epoch": [0, "1"],
    "num_sanity_val_steps": [-2, "2"],
    "log_every_n_steps": [0, "50"],
    "reload_dataloaders_every_n_epochs": [-1, "1", None],
    "limit_train_batches": [-1, 1.5, "all", float("nan")],
    "limit_val_batches": [-1, 2.0],
    "limit_test_batches": [-3, "1"],
    "limit_predict_batches": [-1, -0.5],
    "val_check_interval": [0, 1.5, "1", -1],
    "gradient_clip_val": [-1.0, "1", float("inf")],
    "gradient_clip_algorithm": ["l2", 1],
    "preemption": ["yes", 1, Preemption],
    "inference_mode": ["False", 0, None],
    "use_distributed_sampler": ["no", 1],
    "detect_anomaly": ["True", 1],
    "nonfinite_loss": ["explode", None],
    "compile": ["yes", {"unknown": 1}, {"backend": 3}],
    "profiler": ["fast", 3, object()],
}
#: Good values per assignable setting (None where the constructor takes it: it resolves to the same default).
GOOD: dict[str, list[Any]] = {
    "max_epochs": [3, -1, None],
    "min_epochs": [0, 2, None],
    "max_steps": [7, -1],
    "min_steps": [0, 3, None],
    "accumulate_grad_batches": [1, 4],
    "check_val_every_n_epoch": [2, None],
    "num_sanity_val_steps": [0, -1, None],
    "log_every_n_steps": [1, 10, None],
    "reload_dataloaders_every_n_epochs": [0, 2],
    "limit_train_batches": [0, 3, 0.5, 1.0, None],
    "limit_val_batches": [0, 2, 0.25, None],
    "limit_test_batches": [1, None],
    "limit_predict_batches": [2, 0.0],
    "val_check_interval": [0.5, 2, None],
    "gradient_clip_val": [0.5, 0, None],
    "gradient_clip_algorithm": ["norm", "value", GradClipAlgorithmType.VALUE, None],
    "inference_mode": [False, True],
    "use_distributed_sampler": [False],
    "detect_anomaly": [True, False],
    "nonfinite_loss": ["skip", "raise"],
}
#: The constructor argument behind a setting, where the names differ.
ARGUMENT = {"loggers": "logger"}


def _trainer(**kwargs: Any) -> phalanx.Trainer:
    return quiet_trainer(**kwargs)


def test_every_setting_is_assignable_or_read_only() -> None:
    trainer = _trainer()
    collaborators = {"state", "fit_loop", "strategy"}
    held = {name for name in vars(trainer) if not name.startswith("_")} - collaborators
    arguments = set(inspect.signature(phalanx.Trainer.__init__).parameters) - {"self"}
    tables = set(ASSIGNABLE) | set(READ_ONLY) | {"logger"}  # logger: Lightning's setter, which sets trainer.loggers
    assert held | arguments <= tables
    assert set(BAD) | {"callbacks", "loggers"} == set(ASSIGNABLE)
    assert not set(ASSIGNABLE) & set(READ_ONLY)


def test_every_name_lightning_lets_a_user_assign_is_checked_or_refused() -> None:
    lightning = pytest.importorskip("pytorch_lightning")
    probe = lightning.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    arguments = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    assignable, missing = set(), object()
    for name in arguments:
        held = inspect.getattr_static(probe, name, missing) is not missing
        static = getattr(type(probe), name, None)
        if isinstance(static, property) and static.fset is not None or held and static is None:
            assignable.add(name)
    ours = set(inspect.signature(phalanx.Trainer.__init__).parameters) | set(vars(_trainer()))
    # enable_autolog_hparams: a Lightning argument phalanx does not have (Trainer(enable_autolog_hparams=...) fails).
    assert {"accumulate_grad_batches", "limit_train_batches", "logger", "callbacks", "gradient_clip_val"} <= assignable
    assert assignable & ours <= set(ASSIGNABLE) | set(READ_ONLY) | {"logger"}


def _constructor_error(name: str, value: Any) -> BaseException:
    with pytest.raises((TypeError, ValueError)) as raised:
        _trainer(**{ARGUMENT.get(name, name): value})
    return raised.value


@pytest.mark.parametrize(("name", "value"), [(name, value) for name, values in BAD.items() for value in values])
def test_a_bad_value_is_refused_on_assignment_as_the_constructor_refuses_it(name: str, value: Any) -> None:
    trainer = _trainer()
    before = getattr(trainer, name)
    with pytest.raises(type(_constructor_error(name, value)), match=re.escape(str(_constructor_error(name, value)))):
        setattr(trainer, name, value)
    assert getattr(trainer, name) is before  # nothing changed


@pytest.mark.parametrize(("name", "value"), [(name, value) for name, values in GOOD.items() for value in values])
def test_a_good_value_is_kept_as_the_constructor_resolves_it(name: str, value: Any) -> None:
    trainer = _trainer(max_time=None)
    setattr(trainer, name, value)
    assert getattr(trainer, name) == getattr(_trainer(**{name: value}), name)


#: Values that depend on another setting, and what the assignment keeps.
RELATED = [
    ({"max_steps": 5}, "max_epochs", None, -1),  # max_steps bounds the run: no epoch limit, as the constructor says
    ({"max_time": "00:00:01:00"}, "max_epochs", None, -1),
    ({}, "max_epochs", None, 1000),
    ({"barebones": True}, "num_sanity_val_steps", None, 0),  # barebones: the default is no sanity check
    ({"barebones": True}, "log_every_n_steps", None, 0),
]


@pytest.mark.parametrize(("given", "name", "value", "kept"), RELATED)
def test_none_resolves_with_the_other_settings_as_the_constructor_does(given, name, value, kept) -> None:
    trainer = _trainer(**given)
    setattr(trainer, name, value)
    assert getattr(trainer, name) == kept


#: (first assignment, second one): the second puts a minimum above its maximum.
CROSSED = [
    (("max_steps", 5), ("min_steps", 10), "min_steps=10 is more than max_steps=5"),
    (("min_steps", 10), ("max_steps", 5), "min_steps=10 is more than max_steps=5"),
    (("max_epochs", 2), ("min_epochs", 3), "min_epochs=3 is more than max_epochs=2"),
    (("min_epochs", 3), ("max_epochs", 2), "min_epochs=3 is more than max_epochs=2"),
]


@pytest.mark.parametrize(("first", "second", "message"), CROSSED)
def test_a_minimum_above_its_maximum_is_refused(first, second, message) -> None:
    trainer = _trainer()
    setattr(trainer, *first)
    with pytest.raises(ValueError, match=message):
        setattr(trainer, *second)
    assert getattr(trainer, first[0]) == first[1]


#: Assignments of objects, and what the Trainer keeps.
OBJECTS: list[tuple[str, Any, Any]] = [
    ("loggers", None, []),
    ("loggers", [], []),
    ("logger", None, []),  # Lightning's setter: one logger, or None/False for none
    ("logger", False, []),
    ("preemption", False, None),
    ("compile", True, {}),
    ("compile", None, None),
    ("callbacks", None, []),
]


@pytest.mark.parametrize(("value", "kept"), [("simple", "SimpleProfiler"), (None, "PassThroughProfiler")])
def test_a_profiler_assigned_is_resolved_as_the_constructor_resolves_it(value: Any, kept: str) -> None:
    trainer = _trainer()
    trainer.profiler = value
    assert type(trainer.profiler).__name__ == type(_trainer(profiler=value).profiler).__name__ == kept


@pytest.mark.parametrize(("name", "value", "kept"), OBJECTS)
def test_objects_are_kept_as_the_constructor_resolves_them(name: str, value: Any, kept: Any) -> None:
    trainer = _trainer(logger=CSVLogger("unused"), callbacks=[EarlyStopping(monitor="loss")])
    setattr(trainer, name, value)
    assert getattr(trainer, "loggers" if name == "logger" else name) == kept


def test_a_logger_and_callbacks_assigned_are_kept_and_checked(tmp_path: Path) -> None:
    trainer = _trainer()
    logger, callback = CSVLogger(tmp_path), EarlyStopping(monitor="loss")
    trainer.logger = logger
    trainer.callbacks = [callback]
    trainer.preemption = True
    assert trainer.loggers == [logger] and trainer.logger is logger and trainer.callbacks == [callback]
    assert isinstance(trainer.preemption, Preemption)
    with pytest.raises(TypeError, match="is not a Logger"):
        trainer.logger = "csv"
    with pytest.raises(TypeError, match=r"callbacks\[0\]=.* is not a phalanx Callback"):
        trainer.callbacks = [print]
    assert trainer.loggers == [logger] and trainer.callbacks == [callback]


@pytest.mark.parametrize("name", sorted(READ_ONLY))
def test_a_setting_used_at_construction_only_is_refused_with_its_reason(name: str) -> None:
    trainer = _trainer()
    before = vars(trainer).get(name)
    with pytest.raises(AttributeError, match=rf"trainer\.{name} cannot be assigned after construction: .*new Trainer"):
        setattr(trainer, name, 1)
    assert vars(trainer).get(name) is before


#: Assignments a barebones Trainer refuses: they turn on what barebones mode turns off.
BAREBONES = [
    ("loggers", lambda root: [CSVLogger(root)], "turns off logging"),
    ("logger", lambda root: CSVLogger(root), "turns off logging"),
    ("log_every_n_steps", lambda root: 5, "turns off logging"),
    ("num_sanity_val_steps", lambda root: 2, "turns off the sanity check"),
    ("detect_anomaly", lambda root: True, "turns off anomaly detection"),
    ("callbacks", lambda root: [ModelCheckpoint(root)], "turns off checkpointing"),
    ("callbacks", lambda root: [TQDMProgressBar()], "the progress bar"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAREBONES)
def test_a_barebones_trainer_refuses_what_its_constructor_would(tmp_path: Path, name, value, message) -> None:
    trainer = _trainer(barebones=True)
    with pytest.raises(ValueError, match=f"barebones.*{message}|{message}.*barebones"):
        setattr(trainer, name, value(tmp_path))
    assert trainer.loggers == [] and trainer.log_every_n_steps == 0 and trainer.num_sanity_val_steps == 0


RUN_FIELDS = [name for name, value in vars(phalanx.Trainer).items() if type(value).__name__ in ("RunField",)]


@pytest.mark.parametrize("name", sorted({*ASSIGNABLE, *READ_ONLY, *RUN_FIELDS, "ckpt_path", "state", "fit_loop"}))
def test_nothing_of_the_trainer_can_be_deleted(name: str) -> None:
    trainer = _trainer()
    with pytest.raises(AttributeError, match=rf"trainer\.{name} cannot be deleted"):
        delattr(trainer, name)


def test_the_run_fields_are_found() -> None:
    assert {"should_stop", "preempted", "num_training_batches"} <= set(RUN_FIELDS)
    assert set(RUN_FIELDS) <= {field for field in RunState.__dataclass_fields__}


def test_an_attribute_of_the_users_own_is_left_alone() -> None:
    trainer = _trainer()
    trainer.my_note = "anything"
    del trainer.my_note
    assert not hasattr(trainer, "my_note")


#: Lightning's place for the epoch and step limits: trainer.fit_loop.<name> = N is the Trainer's setting.
FIT_LOOP = [("max_epochs", 2), ("min_epochs", 1), ("max_steps", 5), ("min_steps", 2)]


@pytest.mark.parametrize(("name", "value"), FIT_LOOP)
def test_fit_loop_limits_are_the_trainers_settings(name: str, value: int) -> None:
    trainer = _trainer()
    setattr(trainer.fit_loop, name, value)
    assert getattr(trainer, name) == getattr(trainer.fit_loop, name) == value
    with pytest.raises(ValueError, match=f"{name}='3' is not valid"):
        setattr(trainer.fit_loop, name, "3")


#: Settings assigned between two fits, and what the second fit must show of them.
HONOURED = [
    ("fit_loop.max_epochs", 3, lambda trainer: trainer.current_epoch == 3),
    ("max_steps", 6, lambda trainer: trainer.global_step == 6),
    ("limit_train_batches", 2, lambda trainer: trainer.num_training_batches == 2),
    ("limit_val_batches", 0, lambda trainer: not trainer.validation_enabled),
]


@pytest.mark.parametrize(("name", "value", "shows"), HONOURED)
def test_an_assigned_setting_is_honoured_by_the_next_fit(name: str, value: int, shows) -> None:
    trainer = _trainer(max_epochs=1)
    model = Regressor()
    trainer.fit(model, *loaders(n=32))
    holder, _, attribute = name.rpartition(".")
    setattr(getattr(trainer, holder) if holder else trainer, attribute, value)
    if attribute == "max_steps":
        trainer.fit_loop.max_epochs = -1
    trainer.fit(model, *loaders(n=32))
    assert shows(trainer)
