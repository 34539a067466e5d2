"""``Trainer(barebones=True)``: every feature that costs time beside the training itself is off, to measure the
Trainer's own overhead (Lightning's mode of the same name).

Off: checkpointing, loggers, step logging (``log_every_n_steps=0``), the progress bar, the model summary and the
sanity check; ``self.log`` / ``self.log_dict`` raise. Turning one of them on explicitly at the same time raises a
ValueError naming the argument, as do the debugging aids that are not meant for speed runs (``fast_dev_run``,
``detect_anomaly``).
"""

from __future__ import annotations

from typing import Any

from phalanx.callbacks import ModelCheckpoint, ProgressBar
from phalanx.callbacks.callback import Callback
from phalanx.trainer.logging.results import LoggedResults
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.messages import shown
from phalanx.utilities.rank_zero import rank_zero_info


def _is_on(name: str, value: Any) -> bool:
    """Whether the argument ``name=value`` asks for a feature barebones mode turns off (None: the default)."""
    if name in ("logger", "log_every_n_steps", "num_sanity_val_steps"):
        return value is not None and value is not False and value != 0
    return bool(value)


_WHY = {
    "enable_checkpointing": "checkpointing",
    "logger": "logging",
    "log_every_n_steps": "logging",
    "enable_progress_bar": "the progress bar",
    "enable_model_summary": "the model summary",
    "num_sanity_val_steps": "the sanity check",
    "fast_dev_run": "a development run (not a speed measurement)",
    "detect_anomaly": "anomaly detection",
    "profiler": "profiling",
}


def check_barebones(callbacks: Any, **arguments: Any) -> None:
    """Raise ValueError for an argument, or a callback in ``callbacks``, that turns on what ``barebones=True`` turns
    off."""
    for name, value in arguments.items():
        if _is_on(name, value):
            raise ValueError(
                f"Trainer(barebones=True, {name}={shown(value)}): barebones mode turns off {_WHY[name]}, "
                f"which costs time beside training. Remove {name}= (or pass barebones=False to keep it)."
            )
    items = (
        [callbacks] if isinstance(callbacks, Callback) else callbacks if isinstance(callbacks, (list, tuple)) else []
    )
    for callback in items:
        if isinstance(callback, (ModelCheckpoint, ProgressBar)):
            raise ValueError(
                f"Trainer(barebones=True) turns off checkpointing and the progress bar, but callbacks= holds a"
                f" {type(callback).__name__}. Remove it, or pass barebones=False."
            )
    # Without a progress bar a long run looks hung: say once what is off.
    rank_zero_info(
        "Trainer(barebones=True): checkpointing, loggers, step logging, self.log, the progress bar, the model summary"
        " and the sanity check are off, to measure the Trainer's own overhead."
    )


def check_barebones_assignment(name: str, value: Any) -> None:
    """Raise ValueError when ``trainer.name = value`` on a barebones Trainer turns on what barebones mode turns off
    (the checks of :func:`check_barebones`, for a setting assigned after construction)."""
    argument = "logger" if name == "loggers" else name
    turned_on = bool(value) if name == "loggers" else name in _WHY and _is_on(name, value)
    if turned_on:
        raise ValueError(
            f"trainer.{name} = {shown(value)} on a Trainer(barebones=True): barebones mode turns off {_WHY[argument]},"
            f" which costs time beside training. Build the Trainer with barebones=False to use it."
        )
    if name == "callbacks" and any(isinstance(callback, (ModelCheckpoint, ProgressBar)) for callback in value):
        raise ValueError(
            "trainer.callbacks = [...] holds a checkpoint or progress bar callback, but Trainer(barebones=True) turns"
            " off checkpointing and the progress bar. Remove it, or build the Trainer with barebones=False."
        )


class BarebonesResults(LoggedResults):
    """What ``self.log`` records under ``barebones=True``: nothing; every call raises."""

    def log(self, fx_name: str | None, name: str, value: Any, **options: Any) -> None:
        """Refuse: logging is off in barebones mode."""
        raise MisconfigurationError(
            f"self.log({name!r}, ...) was called{f' in {fx_name}' if fx_name else ''}, "
            f"but Trainer(barebones=True) turns logging off. Remove the self.log / self.log_dict calls, "
            "or pass barebones=False."
        )


__all__ = ["BarebonesResults", "check_barebones", "check_barebones_assignment"]
