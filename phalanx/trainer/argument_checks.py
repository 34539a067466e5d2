"""The checks that argument resolution (:mod:`phalanx.trainer.arguments`) is made of: each error names the argument,
what was given and the valid choices."""

from __future__ import annotations

import math
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from phalanx.utilities.checks import is_int_at_least, is_number
from phalanx.utilities.messages import shown

#: What ``Trainer(nonfinite_loss=...)`` accepts; see the Trainer docstring for what each does.
NONFINITE_LOSS_MODES = ("warn", "skip", "stop", "raise", "ignore")

_MAX_TIME_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")
_MAX_TIME_FORMAT = "a 'DD:HH:MM:SS' string (e.g. '00:12:00:00'), a datetime.timedelta, or a dict such as {'hours': 12}"


def parse_max_time(max_time: Any) -> float | None:
    """``max_time`` in seconds (None: no limit)."""
    if max_time is None:
        return None
    if isinstance(max_time, timedelta):
        seconds = max_time.total_seconds()
    elif isinstance(max_time, dict):
        seconds = _max_time_from_dict(max_time)
    elif isinstance(max_time, str):
        match = re.fullmatch(r"(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})", max_time.strip())
        if match is None:
            raise ValueError(
                f"max_time={max_time!r} is not valid; pass {_MAX_TIME_FORMAT}. The string must look like 'DD:HH:MM:SS'."
            )
        days, hours, minutes, secs = (int(part) for part in match.groups())
        seconds = _timedelta_seconds(max_time, days=days, hours=hours, minutes=minutes, seconds=secs)
    else:
        raise TypeError(
            f"max_time={shown(max_time)} (of type {type(max_time).__name__}) is not valid; pass {_MAX_TIME_FORMAT}."
        )
    if not seconds > 0:
        raise ValueError(f"max_time={max_time!r} must be a positive duration; pass {_MAX_TIME_FORMAT}.")
    return seconds


def _max_time_from_dict(max_time: dict[Any, Any]) -> float:
    unknown = [key for key in max_time if key not in _MAX_TIME_KEYS]
    if unknown:
        raise ValueError(f"max_time={max_time!r} has unknown key(s) {unknown}; valid keys: {list(_MAX_TIME_KEYS)}.")
    for key, value in max_time.items():
        if not is_number(value):
            raise TypeError(
                f"max_time[{key!r}]={shown(value)} must be a number (int or float), e.g. max_time={{'hours': 12}}."
            )
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"max_time[{key!r}]={value!r} must be a finite number >= 0, e.g. max_time={{'hours': 12}}."
            )
    return _timedelta_seconds(max_time, **max_time)


def _timedelta_seconds(given: Any, **parts: float) -> float:
    try:
        return timedelta(**parts).total_seconds()
    except OverflowError:
        raise ValueError(f"max_time={given!r} is longer than a datetime.timedelta can hold (999999999 days).") from None


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Raise unless ``value`` is an int >= ``minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if not is_int_at_least(value, minimum):
        raise ValueError(
            f"{name}={shown(value)} is not valid; it must be an int >= {minimum}{' or None' if allow_none else ''}."
        )


def check_bool(name: str, value: Any, allow_none: bool = False) -> None:
    """Raise unless ``value`` is True or False (or None when allowed): a string such as 'False' would count as True."""
    if isinstance(value, bool) or (value is None and allow_none):
        return
    raise TypeError(
        f"{name}={shown(value)} is not valid; pass True or False{' (or None for the default)' if allow_none else ''}."
    )


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise unless ``value`` is one of ``choices`` (compared with their types, so that 1 is not True)."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        names = [repr(choice) for choice in choices if choice is not None]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ValueError(
            f"{name}={shown(value)} is not valid; choose {listed}{' (or None)' if None in choices else ''}."
        )


def check_number(name: str, value: Any, minimum: float) -> None:
    """Raise unless ``value`` is a finite int or float >= ``minimum``."""
    if not is_number(value) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name}={shown(value)} is not valid; it must be a finite number >= {minimum}.")


def resolve_root_dir(value: Any) -> str:
    """``default_root_dir`` as a string (the working directory for None), refusing what cannot become a directory."""
    if value is None:
        return os.getcwd()
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"default_root_dir={shown(value)} (of type {type(value).__name__}) is not valid; pass a path (str or"
            " pathlib.Path) to a directory, or None for the working directory."
        )
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"default_root_dir={shown(value)} is a bytes path; pass it as a str or pathlib.Path.")
    if not path.strip():
        raise ValueError("default_root_dir='' is not a path; pass a directory, or None for the working directory.")
    if "\x00" in path:
        raise ValueError(f"default_root_dir={path!r} contains a NUL character, which no file system accepts.")
    if "://" in path:
        return path  # a remote file system (fsspec URL): nothing to check locally
    _check_directory_possible(Path(path), path)
    return path


def _check_directory_possible(path: Path, given: str) -> None:
    # Every existing part of the path must be a directory, or nothing can be written below it.
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is an existing file" if candidate == path else f"is below the existing file {candidate}"
                raise ValueError(f"default_root_dir={given!r} {where}; pass a directory (it is created when missing).")
            return


# Lightning Trainer arguments phalanx takes but has no integration for: accepted as None (their default), otherwise
# refused at construction with what to do instead.
_NOT_INTEGRATED = {
    "model_registry": "phalanx has no model registry integration; upload the checkpoint files ModelCheckpoint writes"
    " yourself",
}


def refuse_not_integrated(**arguments: Any) -> None:
    """Raise for a Lightning argument phalanx accepts only as None (``model_registry``)."""
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(
                f"{name}={shown(value)} is not supported: {_NOT_INTEGRATED[name]}. Pass {name}=None (the default)."
            )


# Lightning Trainer attributes spelled differently here: reading one raises an AttributeError saying what to use.
RENAMED_TRAINER_ATTRIBUTES = {"lightning_module": "trainer.module"}


__all__ = [
    "NONFINITE_LOSS_MODES",
    "RENAMED_TRAINER_ATTRIBUTES",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "parse_max_time",
    "refuse_not_integrated",
    "resolve_root_dir",
]
