"""Hyper-parameter containers and checks."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping
from types import FrameType
from typing import Any


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"No hyper-parameter named {key!r}; saved: {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def init_arguments_of_frame(frame: FrameType) -> dict[str, Any]:
    """Return the arguments of the function running in ``frame`` (``self`` and ``__class__`` excluded, ``**kwargs``
    merged)."""
    info = inspect.getargvalues(frame)
    values: dict[str, Any] = {}
    for name in info.args:
        if name not in ("self", "__class__"):
            values[name] = info.locals[name]
    code = frame.f_code
    keyword_only = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    for name in keyword_only:
        values[name] = info.locals[name]
    if info.keywords:
        values.update(info.locals[info.keywords])
    return values


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def is_plain(value: Any) -> bool:
    """Whether ``value`` is made only of dicts with str keys, lists, tuples, str, int, float, bool and None."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, (str, int)) and is_plain(item) for key, item in value.items())
    return False


def select_hyperparameters(args: tuple[Any, ...], *, ignore: Any, frame: FrameType | None) -> dict[str, Any]:
    """What ``save_hyperparameters(*args, ignore=...)`` records: a dict/Namespace, or named or all __init__ args."""
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    if len(args) == 1 and isinstance(args[0], (Mapping, argparse.Namespace)):
        values = dict(vars(args[0]) if isinstance(args[0], argparse.Namespace) else args[0])
    else:
        init_args = init_arguments_of_frame(frame) if frame is not None else {}
        if args:
            unknown = [name for name in args if name not in init_args]
            if unknown:
                raise ValueError(
                    f"save_hyperparameters got {unknown}, which are not arguments of __init__: {sorted(init_args)}."
                )
            values = {name: init_args[name] for name in args}
        else:
            values = init_args
    return {key: value for key, value in values.items() if key not in ignored}
