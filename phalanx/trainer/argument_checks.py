"""The checks that argument resolution (:mod:`phalanx.trainer.arguments`) is made of: each error names the argument,
what was given and the valid choices."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from phalanx.utilities.checks import is_int_at_least, is_number
from phalanx.utilities.durations import parse_duration
from phalanx.utilities.messages import shown

#: What ``Trainer(nonfinite_loss=...)`` accepts; see the Trainer docstring for what each does.
NONFINITE_LOSS_MODES = ("warn", "skip", "stop", "raise", "ignore")


def parse_max_time(max_time: Any) -> float | None:
    """``max_time`` in seconds (None: no limit)."""
    return parse_duration(max_time, "max_time")


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
