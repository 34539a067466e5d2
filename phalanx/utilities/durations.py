"""Durations as Lightning accepts them (a 'DD:HH:MM:SS' string, a timedelta or a dict of its keywords), in seconds."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

from phalanx.utilities.checks import is_number
from phalanx.utilities.messages import shown

DURATION_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")
DURATION_FORMAT = "a 'DD:HH:MM:SS' string (e.g. '00:12:00:00'), a datetime.timedelta, or a dict such as {'hours': 12}"


def parse_duration(value: Any, name: str) -> float | None:
    """``value`` (the argument ``name``) in seconds; None stays None. Raises TypeError or ValueError naming ``name``
    for anything else than a positive duration in one of Lightning's three forms."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, dict):
        seconds = _seconds_from_dict(value, name)
    elif isinstance(value, str):
        match = re.fullmatch(r"(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})", value.strip())
        if match is None:
            raise ValueError(
                f"{name}={value!r} is not valid; pass {DURATION_FORMAT}. The string must look like 'DD:HH:MM:SS'."
            )
        days, hours, minutes, secs = (int(part) for part in match.groups())
        seconds = _timedelta_seconds(value, name, days=days, hours=hours, minutes=minutes, seconds=secs)
    else:
        raise TypeError(f"{name}={shown(value)} (of type {type(value).__name__}) is not valid; pass {DURATION_FORMAT}.")
    if not seconds > 0:
        raise ValueError(f"{name}={value!r} must be a positive duration; pass {DURATION_FORMAT}.")
    return seconds


def _seconds_from_dict(value: dict[Any, Any], name: str) -> float:
    unknown = [key for key in value if key not in DURATION_KEYS]
    if unknown:
        raise ValueError(f"{name}={value!r} has unknown key(s) {unknown}; valid keys: {list(DURATION_KEYS)}.")
    for key, part in value.items():
        if not is_number(part):
            raise TypeError(
                f"{name}[{key!r}]={shown(part)} must be a number (int or float), e.g. {name}={{'hours': 12}}."
            )
        if not math.isfinite(part) or part < 0:
            raise ValueError(f"{name}[{key!r}]={part!r} must be a finite number >= 0, e.g. {name}={{'hours': 12}}.")
    return _timedelta_seconds(value, name, **value)


def _timedelta_seconds(given: Any, name: str, **parts: float) -> float:
    try:
        return timedelta(**parts).total_seconds()
    except OverflowError:
        raise ValueError(f"{name}={given!r} is longer than a datetime.timedelta can hold (999999999 days).") from None


__all__ = ["DURATION_FORMAT", "DURATION_KEYS", "parse_duration"]
