"""Settings assigned to a Trainer after its construction: each is checked as the constructor checks it, or refused with
the reason when the Trainer used it at construction only.

``Trainer.__setattr__`` sends every assignment here. A setting in :data:`ASSIGNABLE` is checked (and resolved: None
becomes the default, as in the constructor) once the Trainer holds it, so the constructor's own first assignments are
not checked twice; a name in :data:`READ_ONLY` is refused with its reason. Lightning 2.6 checks none of these when
they are assigned; its read-only ``max_epochs``/``max_steps`` are assigned through ``trainer.fit_loop``, which phalanx
honours too (see ``FitLoop``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from phalanx.loggers.logger import logger_list
from phalanx.trainer.argument_checks import NONFINITE_LOSS_MODES, check_bool, check_choice, check_int, check_number
from phalanx.trainer.arguments import (
    check_bounds,
    resolve_clip_algorithm,
    resolve_preemption,
    resolve_val_check_interval,
)
from phalanx.trainer.logging.barebones import check_barebones_assignment
from phalanx.trainer.logging.loggers_and_callbacks import callback_list
from phalanx.trainer.loops.data import validate_limit
from phalanx.trainer.profiling import resolve_profiler
from phalanx.utilities.compile import check_compile

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

#: Checks a value assigned to the Trainer and returns the value to keep.
Check = Callable[["Trainer", Any], Any]
_BOUNDED = ("max_steps", "min_steps", "max_epochs", "min_epochs")


def _count(name: str, minimum: int, default: Callable[[Trainer], Any] | None = None) -> Check:
    """An int >= ``minimum``; None allowed where the constructor allows it, becoming ``default(trainer)``."""

    def check(trainer: Trainer, value: Any) -> Any:
        check_int(name, value, minimum, allow_none=default is not None)
        value = default(trainer) if value is None and default is not None else value
        if name in _BOUNDED:  # a minimum above its maximum is refused, as the constructor refuses it
            check_bounds(**{**{bound: getattr(trainer, bound) for bound in _BOUNDED}, name: value})
        return value

    return check


def _default_max_epochs(trainer: Trainer) -> int:
    # The constructor's rule: 1000 epochs unless max_steps or max_time bounds the run.
    return 1000 if trainer.max_steps == -1 and trainer._max_time is None else -1


def _flag(name: str) -> Check:
    def check(trainer: Trainer, value: Any) -> Any:
        check_bool(name, value)
        return value

    return check


def _limit(name: str) -> Check:
    return lambda trainer, value: validate_limit(name, 1.0 if value is None else value)


def _clip_val(trainer: Trainer, value: Any) -> Any:
    if value is not None:
        check_number("gradient_clip_val", value, 0)
    return value


def _nonfinite_loss(trainer: Trainer, value: Any) -> Any:
    check_choice("nonfinite_loss", value, NONFINITE_LOSS_MODES)
    return value


def _loggers(trainer: Trainer, value: Any) -> Any:
    # As Lightning's setter: None (or an empty list) means no logger.
    return (
        logger_list(value, argument="trainer.loggers", choices="a list of Logger instances, or [] for none")
        if value
        else []
    )


ASSIGNABLE: dict[str, Check] = {
    "max_epochs": _count("max_epochs", -1, _default_max_epochs),
    "min_epochs": _count("min_epochs", 0, lambda trainer: 0),
    "max_steps": _count("max_steps", -1),
    "min_steps": _count("min_steps", 0, lambda trainer: 0),
    "accumulate_grad_batches": _count("accumulate_grad_batches", 1),
    "check_val_every_n_epoch": _count("check_val_every_n_epoch", 1, lambda trainer: None),
    "num_sanity_val_steps": _count("num_sanity_val_steps", -1, lambda trainer: 0 if trainer.barebones else 2),
    "log_every_n_steps": _count("log_every_n_steps", 1, lambda trainer: 0 if trainer.barebones else 50),
    "reload_dataloaders_every_n_epochs": _count("reload_dataloaders_every_n_epochs", 0),
    **{name: _limit(name) for name in (f"limit_{stage}_batches" for stage in ("train", "val", "test", "predict"))},
    "val_check_interval": lambda trainer, value: resolve_val_check_interval(value),
    "gradient_clip_val": _clip_val,
    "gradient_clip_algorithm": lambda trainer, value: resolve_clip_algorithm(value),
    "preemption": lambda trainer, value: resolve_preemption(value),
    **{name: _flag(name) for name in ("inference_mode", "use_distributed_sampler", "detect_anomaly")},
    "nonfinite_loss": _nonfinite_loss,
    "compile": lambda trainer, value: check_compile(value, "Trainer"),
    "callbacks": lambda trainer, value: callback_list(value),
    "loggers": _loggers,
    # As in Lightning, a profiler assigned between stages profiles the next ones (each stage sets it up anew).
    "profiler": lambda trainer, value: resolve_profiler(value),
}

_STRATEGY = "the strategy was built from it at construction"
_CALLBACK = "it added or left out its callback at construction; change trainer.callbacks instead"
#: Settings the Trainer used at construction only, with the reason an assignment is refused.
READ_ONLY: dict[str, str] = {
    "barebones": "it chose what the Trainer records and turned features off at construction",
    "fast_dev_run": "it set the limit_*_batches, max_steps, max_epochs and the sanity check at construction; assign"
    " those instead",
    "overfit_batches": "it set limit_train_batches and limit_val_batches at construction; assign those instead",
    "default_root_dir": "the default logger and checkpoint folder were placed under it at construction",
    "deterministic": "it set torch's process-wide switches at construction; call torch.use_deterministic_algorithms()"
    " to change them",
    "benchmark": "it set torch.backends.cudnn.benchmark at construction; set that instead",
    "max_time": "it added its Timer callback at construction; change the Timer in trainer.callbacks instead",
    **{name: _STRATEGY for name in ("strategy", "accelerator", "devices", "num_nodes", "precision", "plugins")},
    "sync_batchnorm": _STRATEGY,
    **{name: _CALLBACK for name in ("enable_checkpointing", "enable_progress_bar", "enable_model_summary")},
    "model_registry": "phalanx has no model registry integration",
}
# Names the Trainer never holds as attributes of its own (constructor arguments it resolved into others, and
# properties): an assignment of one is checked although the Trainer does not hold it.
_HELD = ("barebones", "fast_dev_run", "overfit_batches", "default_root_dir", "deterministic", "strategy", "precision")
_NEVER_HELD = {"logger", *READ_ONLY} - {*_HELD, "sync_batchnorm"}


def checked_assignment(trainer: Trainer, name: str, value: Any) -> tuple[str, Any]:
    """The attribute ``trainer.name = value`` sets and the value it keeps; raises for a bad value or a read-only name.

    Raises a TypeError or ValueError (the constructor's messages) for a bad value, an AttributeError for a setting the
    Trainer used at construction only.
    """
    if name not in _NEVER_HELD and name not in vars(trainer):
        return name, value  # the constructor's first assignment, or an attribute of the user's own
    if name in READ_ONLY:
        raise AttributeError(
            f"trainer.{name} cannot be assigned after construction: {READ_ONLY[name]}. Pass {name}= to a new"
            f" Trainer(...) instead."
        )
    if name == "logger":  # Lightning's setter: one logger, or None/False for none
        name, value = "loggers", [] if value is None or value is False else [value]
    check = ASSIGNABLE.get(name)
    if check is None:
        return name, value  # a collaborator (state, fit_loop, ...) or an attribute of the user's own
    value = check(trainer, value)
    if trainer.barebones:
        check_barebones_assignment(name, value)
    return name, value


def refuse_deletion(name: str) -> None:
    """Raise an AttributeError for ``del trainer.name`` of a setting or a collaborator: the Trainer reads them."""
    if name in ASSIGNABLE or name in READ_ONLY or name in ("state", "fit_loop", "logger"):
        raise AttributeError(
            f"trainer.{name} cannot be deleted: the Trainer reads it."
            f" Assign a valid value instead, or build a new Trainer."
        )


class TrainerSetting:
    """A Trainer setting seen from a collaborator under the same name (Lightning's ``trainer.fit_loop.max_epochs``):
    reading it reads the Trainer's; assigning it assigns the Trainer's, checked as ``trainer.<name> = ...`` is."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, holder: Any, owner: type | None = None) -> Any:
        return self if holder is None else getattr(holder.trainer, self.name)

    def __set__(self, holder: Any, value: Any) -> None:
        setattr(holder.trainer, self.name, value)


__all__ = ["ASSIGNABLE", "READ_ONLY", "TrainerSetting", "checked_assignment", "refuse_deletion"]
