"""Phrases bad-argument errors the same way everywhere: the value as shown, a class given for an instance."""

from __future__ import annotations

from typing import Any


def shown(value: Any) -> str:
    """``value`` for an error message: its repr, shortened, or the class name for a class."""
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def reject_class(name: str, value: Any, base: type, choices: str, *, arguments: str = "") -> None:
    """Raise when ``value`` is a subclass of ``base`` (a class given where an instance is needed); the example call
    shows ``arguments`` (what every instance needs, e.g. ``"save_dir=..."``)."""
    if isinstance(value, type) and issubclass(value, base):
        suffix = f", or {choices}" if choices else ""
        raise TypeError(
            f"{name}={value.__qualname__} is a class, not an instance; pass an instance, e.g."
            f" {value.__qualname__}({arguments}){suffix}."
        )


__all__ = ["reject_class", "shown"]
