"""Argument resolution: the Trainer's constructor arguments, checked and turned into the settings it runs with.

:func:`resolve_arguments` checks every argument but those that choose the strategy (see
:func:`phalanx.strategies.resolve.resolve_strategy`), fills in the defaults and applies the modes that override other
arguments (``barebones``, ``fast_dev_run``, ``overfit_batches``); it changes nothing outside the settings it returns.
:func:`apply_process_switches` sets torch's process-wide switches (``deterministic``, ``benchmark``); the Trainer
calls it last, so that a Trainer refused for a bad argument leaves them untouched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

import torch

from phalanx.loggers import Logger
from phalanx.plugins import CheckpointIO, ClusterEnvironment, Precision
from phalanx.plugins.layer_sync import LayerSync
from phalanx.profilers import Profiler
from phalanx.trainer.argument_checks import (
    NONFINITE_LOSS_MODES,
    check_bool,
    check_choice,
    check_int,
    check_number,
    parse_max_time,
    refuse_not_integrated,
    resolve_root_dir,
)
from phalanx.trainer.logging.barebones import check_barebones
from phalanx.trainer.logging.loggers_and_callbacks import build_callbacks, build_loggers
from phalanx.trainer.loops.data import validate_limit
from phalanx.trainer.preemption import Preemption
from phalanx.trainer.profiling import resolve_profiler
from phalanx.utilities.compile import check_compile
from phalanx.utilities.enums import GradClipAlgorithmType
from phalanx.utilities.messages import reject_class, shown
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.callbacks.callback import Callback

#: The Trainer arguments that choose and build its strategy (passed on to ``resolve_strategy``).
#: One value of ``Trainer(plugins=...)`` (a sequence of them is accepted too).
PluginInput = Union[Precision, CheckpointIO, ClusterEnvironment, LayerSync]
#: ``Trainer(logger=...)``: loggers, True or None for the default CSVLogger, False for none.
LoggerInput = Union[Logger, Iterable[Logger], bool, None]
#: ``Trainer(devices=...)``: a count, "auto", a device-index string, or a list of device indices.
DevicesInput = Union[int, str, Sequence[int]]
STRATEGY_ARGUMENTS = ("accelerator", "strategy", "devices", "num_nodes", "precision", "plugins", "sync_batchnorm")

_FLAGS = ("sync_batchnorm", "use_distributed_sampler", "inference_mode", "detect_anomaly", "barebones")
_ENABLE_FLAGS = ("enable_progress_bar", "enable_checkpointing", "enable_model_summary")  # None: True
_OPTIONAL_FLAGS = (*_ENABLE_FLAGS, "benchmark")

# The arguments barebones=True refuses when they turn on what it turns off.
_BAREBONES_CHECKED = (
    "enable_checkpointing",
    "logger",
    "log_every_n_steps",
    "enable_progress_bar",
    "enable_model_summary",
    "num_sanity_val_steps",
    "fast_dev_run",
    "detect_anomaly",
    "profiler",
)
# What barebones=True turns off, and the value it sets instead.
_BAREBONES_OFF = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


@dataclass(frozen=True)
class TrainerSettings:
    """The Trainer's arguments once resolved; each field is the Trainer attribute of the same name (``max_time``:
    ``_max_time``, in seconds)."""

    barebones: bool
    detect_anomaly: bool
    nonfinite_loss: str
    default_root_dir: str
    fast_dev_run: bool | int
    max_epochs: int
    min_epochs: int
    max_steps: int
    min_steps: int
    max_time: float | None
    accumulate_grad_batches: int
    check_val_every_n_epoch: int | None
    num_sanity_val_steps: int
    log_every_n_steps: int
    reload_dataloaders_every_n_epochs: int
    limit_train_batches: int | float
    limit_val_batches: int | float
    limit_test_batches: int | float
    limit_predict_batches: int | float
    overfit_batches: int | float
    val_check_interval: int | float
    gradient_clip_val: int | float | None
    gradient_clip_algorithm: GradClipAlgorithmType | None
    preemption: Preemption | None
    deterministic: bool | str | None
    sync_batchnorm: bool
    use_distributed_sampler: bool
    inference_mode: bool
    loggers: list[Any]
    callbacks: list[Callback]
    #: torch.compile's keyword arguments for the strategy's ``compile_module`` step; None: eager.
    compile: dict[str, Any] | None
    #: ``trainer.profiler``: the profiler given, or made from its name; a PassThroughProfiler for None.
    profiler: Profiler

    def trainer_attributes(self) -> dict[str, Any]:
        """The Trainer attributes these settings become, by name."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        values["_max_time"] = values.pop("max_time")
        return values


def resolve_arguments(given: Mapping[str, Any]) -> TrainerSettings:
    """Check the Trainer's arguments ``given`` by name and resolve them into its settings; raise on the first bad one.

    Raises a TypeError or ValueError naming the argument, the value and the valid choices.
    """
    _check_flags(given)
    barebones = given["barebones"]
    if barebones:
        check_barebones(given["callbacks"], **{name: given[name] for name in _BAREBONES_CHECKED})
        given = {**given, **_BAREBONES_OFF}
    default_root_dir = resolve_root_dir(given["default_root_dir"])
    fast_dev_batches = _fast_dev_batches(given["fast_dev_run"])
    counts = _resolve_counts(given, barebones=barebones)
    limits = _resolve_limits(given)
    loop = {**counts, **limits, "val_check_interval": resolve_val_check_interval(given["val_check_interval"])}
    clipping = _resolve_clipping(given["gradient_clip_val"], given["gradient_clip_algorithm"])
    if fast_dev_batches:
        loop.update(_fast_dev_run_overrides(fast_dev_batches))
    overfit_batches = validate_limit("overfit_batches", given["overfit_batches"])
    if overfit_batches:  # wins over limit_*_batches and fast_dev_run for training and validation, as in Lightning
        loop["limit_train_batches"] = loop["limit_val_batches"] = overfit_batches
    preemption = resolve_preemption(given["preemption"])
    enabled = {name: True if given[name] is None else given[name] for name in _ENABLE_FLAGS}
    return TrainerSettings(
        barebones=barebones,
        detect_anomaly=given["detect_anomaly"],
        nonfinite_loss=given["nonfinite_loss"],
        default_root_dir=default_root_dir,
        fast_dev_run=fast_dev_batches if fast_dev_batches else False,
        reload_dataloaders_every_n_epochs=given["reload_dataloaders_every_n_epochs"],
        overfit_batches=overfit_batches,
        preemption=preemption,
        deterministic=given["deterministic"],
        sync_batchnorm=given["sync_batchnorm"],
        use_distributed_sampler=given["use_distributed_sampler"],
        inference_mode=given["inference_mode"],
        loggers=build_loggers(given["logger"] if not fast_dev_batches else False, default_root_dir=default_root_dir),
        callbacks=build_callbacks(given["callbacks"], max_time=loop["max_time"], **enabled),
        compile=check_compile(given["compile"], "Trainer"),
        profiler=resolve_profiler(given["profiler"]),
        **loop,
        **clipping,
    )


def _check_flags(given: Mapping[str, Any]) -> None:
    refuse_not_integrated(model_registry=given["model_registry"])
    for name in _FLAGS:
        check_bool(name, given[name])
    for name in _OPTIONAL_FLAGS:
        check_bool(name, given[name], allow_none=True)
    check_choice("deterministic", given["deterministic"], (None, True, False, "warn"))
    check_choice("nonfinite_loss", given["nonfinite_loss"], NONFINITE_LOSS_MODES)


def _fast_dev_batches(fast_dev_run: Any) -> int:
    """The number of batches ``fast_dev_run`` runs per stage (0: off)."""
    if isinstance(fast_dev_run, bool):
        return 1 if fast_dev_run else 0
    if isinstance(fast_dev_run, int) and fast_dev_run >= 0:
        return fast_dev_run
    raise ValueError(
        f"fast_dev_run={shown(fast_dev_run)} is not valid; it must be a bool or an int >= 0 (number of batches)."
    )


def _resolve_counts(given: Mapping[str, Any], *, barebones: bool) -> dict[str, Any]:
    """The epoch, step and batch counts, checked, with their defaults."""
    max_steps, max_epochs, min_epochs, min_steps = (
        given["max_steps"],
        given["max_epochs"],
        given["min_epochs"],
        given["min_steps"],
    )
    check_int("max_steps", max_steps, -1)
    check_int("max_epochs", max_epochs, -1, allow_none=True)
    check_int("min_epochs", min_epochs, 0, allow_none=True)
    check_int("min_steps", min_steps, 0, allow_none=True)
    check_bounds(max_steps=max_steps, min_steps=min_steps, max_epochs=max_epochs, min_epochs=min_epochs)
    check_int("accumulate_grad_batches", given["accumulate_grad_batches"], 1)
    check_int("check_val_every_n_epoch", given["check_val_every_n_epoch"], 1, allow_none=True)
    check_int("num_sanity_val_steps", given["num_sanity_val_steps"], -1, allow_none=True)
    check_int("log_every_n_steps", given["log_every_n_steps"], 1, allow_none=True)
    check_int("reload_dataloaders_every_n_epochs", given["reload_dataloaders_every_n_epochs"], 0)
    max_time = parse_max_time(given["max_time"])
    if max_epochs is None:
        max_epochs = 1000 if max_steps == -1 and max_time is None else -1
    sanity_steps, log_every = given["num_sanity_val_steps"], given["log_every_n_steps"]
    return {
        "max_time": max_time,
        "max_epochs": max_epochs,
        "min_epochs": min_epochs or 0,
        "min_steps": min_steps or 0,
        "max_steps": max_steps,
        "accumulate_grad_batches": given["accumulate_grad_batches"],
        "check_val_every_n_epoch": given["check_val_every_n_epoch"],
        "num_sanity_val_steps": 2 if sanity_steps is None else sanity_steps,
        # barebones: 0, never log steps (only barebones sets 0; an argument of 0 is refused above)
        "log_every_n_steps": 0 if barebones else 50 if log_every is None else log_every,
    }


def check_bounds(*, max_steps: int, min_steps: int | None, max_epochs: int | None, min_epochs: int | None) -> None:
    """Refuse a minimum above its maximum (-1 or None: no maximum; None: no minimum)."""
    if min_steps is not None and max_steps != -1 and min_steps > max_steps:
        raise ValueError(
            f"min_steps={min_steps} is more than max_steps={max_steps}; lower min_steps or raise max_steps."
        )
    if min_epochs is not None and max_epochs is not None and max_epochs != -1 and min_epochs > max_epochs:
        raise ValueError(
            f"min_epochs={min_epochs} is more than max_epochs={max_epochs}; lower min_epochs or raise max_epochs."
        )


def _resolve_limits(given: Mapping[str, Any]) -> dict[str, int | float]:
    """``limit_{train,val,test,predict}_batches``, checked (None: all batches)."""
    names = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")
    return {name: validate_limit(name, 1.0 if given[name] is None else given[name]) for name in names}


def resolve_val_check_interval(value: Any) -> int | float:
    """``val_check_interval``, checked (None: once per epoch)."""
    if value is None:
        return 1.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or (isinstance(value, float) and not value <= 1.0)
    ):
        raise ValueError(
            f"val_check_interval={shown(value)} is not valid; it must be a float in (0.0, 1.0] (fraction of an epoch)"
            " or an int >= 1 (batches)."
        )
    return value


def _resolve_clipping(gradient_clip_val: Any, gradient_clip_algorithm: Any) -> dict[str, Any]:
    if gradient_clip_val is not None:
        check_number("gradient_clip_val", gradient_clip_val, 0)
    return {
        "gradient_clip_val": gradient_clip_val,
        "gradient_clip_algorithm": resolve_clip_algorithm(gradient_clip_algorithm),
    }


def resolve_clip_algorithm(gradient_clip_algorithm: Any) -> GradClipAlgorithmType | None:
    """``gradient_clip_algorithm``, checked, as the enum ('norm', 'value' or such a member; None stays None)."""
    if isinstance(gradient_clip_algorithm, GradClipAlgorithmType):
        gradient_clip_algorithm = gradient_clip_algorithm.value
    check_choice("gradient_clip_algorithm", gradient_clip_algorithm, (None, "norm", "value"))
    # None stays None, as in Lightning: configure_gradient_clipping and clip_gradients tell "unset" from "norm".
    return None if gradient_clip_algorithm is None else GradClipAlgorithmType(gradient_clip_algorithm)


def _fast_dev_run_overrides(batches: int) -> dict[str, Any]:
    """What ``fast_dev_run`` (``batches`` > 0) sets: that many batches of each stage, one epoch, no sanity check."""
    return {
        "limit_train_batches": batches,
        "limit_val_batches": batches,
        "limit_test_batches": batches,
        "limit_predict_batches": batches,
        "max_steps": batches,
        "max_epochs": 1,
        "num_sanity_val_steps": 0,
        "val_check_interval": 1.0,
        "check_val_every_n_epoch": 1,
        "max_time": None,
    }


def resolve_preemption(preemption: Any) -> Preemption | None:
    """``preemption``, checked: True becomes the default Preemption, False (or None) none."""
    reject_class("preemption", preemption, Preemption, "True or False")
    if preemption is True:
        return Preemption()
    if preemption is False or preemption is None:
        return None
    if not isinstance(preemption, Preemption):
        raise TypeError(
            f"preemption={shown(preemption)} (of type {type(preemption).__name__}) is not valid; pass True, False or a"
            " phalanx.trainer.Preemption instance."
        )
    return preemption


def apply_process_switches(*, deterministic: bool | str | None, benchmark: bool | None) -> None:
    """Set torch's process-wide switches for ``deterministic`` and ``benchmark`` (None leaves a switch as it is)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
        torch.backends.cudnn.deterministic = True
    if benchmark is not None:
        if benchmark and deterministic:
            rank_zero_warn(
                "benchmark=True picks the fastest (possibly non-deterministic) cuDNN kernels, against"
                " deterministic=True."
            )
        torch.backends.cudnn.benchmark = benchmark


__all__ = [
    "STRATEGY_ARGUMENTS",
    "TrainerSettings",
    "apply_process_switches",
    "check_bounds",
    "resolve_arguments",
    "resolve_clip_algorithm",
    "resolve_preemption",
    "resolve_val_check_interval",
]
