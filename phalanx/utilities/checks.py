"""Argument checks shared by every layer: the retyped ``isinstance(x, bool) or not isinstance(x, int) or x < n``.

``bool`` is a subclass of ``int``, so each check rules it out: ``devices=True`` or ``patience=False`` is a mistake, not
the number 1 or 0. The predicates leave each caller's message as it was (tests match them); ``check_int_at_least``
raises with the common wording. No torch import: phalanx.datamodule stays importable without torch.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["check_int_at_least", "is_int", "is_int_at_least", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``."""
    return is_int(value) and value >= minimum


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int_at_least(name: str, value: object, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``, else raise a ValueError naming it."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{hint}.")
    return value
