"""Public helpers for writing a logger: hyperparameters as plain or flat dicts, metric values as numbers, prefixes.

The built-in loggers use them, and a logger of your own needs nothing else (Lightning keeps its equivalents private:
``_convert_params``, ``_flatten_dict``, ``_sanitize_callable_params``, ``_add_prefix``)::

    from phalanx.loggers import Logger, rank_zero_experiment
    from phalanx.loggers.utilities import add_prefix, convert_params, flatten_dict, to_scalar
"""

from __future__ import annotations

import argparse
import inspect
import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any


def convert_params(params: Mapping[str, Any] | argparse.Namespace | None) -> dict[str, Any]:
    """Hyperparameters as a plain dict: a Namespace (nested ones too) becomes a dict, None an empty one."""
    if params is None:
        return {}
    if isinstance(params, argparse.Namespace):
        params = vars(params)
    if not isinstance(params, Mapping):
        raise TypeError(f"Hyperparameters must be a dict or argparse.Namespace, got {type(params).__name__}.")
    return {
        key: convert_params(value) if isinstance(value, argparse.Namespace) else value for key, value in params.items()
    }


def flatten_dict(params: Mapping[Any, Any], delimiter: str = "/", parent_key: str = "") -> dict[str, Any]:
    """One level of keys: ``{"a": {"b": 1}}`` becomes ``{"a/b": 1}``; dataclasses, Namespaces and lists of dicts too."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent_key}{delimiter}{key}" if parent_key else str(key)
        if is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        elif isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, delimiter, name))
        elif isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
            for index, item in enumerate(value):
                flat.update(flatten_dict(item, delimiter, f"{name}{delimiter}{index}"))
        else:
            flat[name] = value
    return flat


def sanitize_callable_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Classes and functions among the values replaced by their names (a tracker cannot store the objects)."""
    # Lightning also calls other callables to store what they return; calling user objects to log them is not done here.
    return {
        key: getattr(value, "__name__", value) if inspect.isclass(value) or inspect.isroutine(value) else value
        for key, value in params.items()
    }


def to_json_values(params: Mapping[str, Any]) -> dict[str, Any]:
    """The values that JSON cannot encode replaced by their ``str`` (for trackers that store a JSON config)."""
    return {key: value if _encodes_as_json(value) else str(value) for key, value in params.items()}


def _encodes_as_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    try:
        json.dumps(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def to_scalar(key: str, value: Any) -> int | float:
    """A metric value (number, numpy scalar, one-element tensor) as a Python number; anything else is refused."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        return value  # type: ignore[return-value]
    item = getattr(value, "item", None)
    if callable(item):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", 1)
        if size != 1:
            raise ValueError(f"Metric {key!r} must be a scalar, got a value with {size} elements.")
        result = item()
        if isinstance(result, bool):
            return int(result)
        if isinstance(result, (int, float)):
            return result
    raise TypeError(f"Metric {key!r} must be a number or a 0-dim tensor, got {type(value).__name__}.")


def add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str = "-") -> dict[str, Any]:
    """``metrics`` with ``prefix`` and ``separator`` before every key (unchanged when ``prefix`` is empty)."""
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def checkpoints_to_log(checkpoint_callback: Any, logged: Mapping[str, float]) -> list[tuple[float, str, Any, str]]:
    """The checkpoint files of ``checkpoint_callback`` to upload: ``(mtime, path, score, tag)``, oldest first.

    They are its last, best and top-k files (``tag`` "latest", "best" or "best_k") that are whole files on disk and
    not in ``logged`` (path -> mtime when uploaded) with this modification time: a file rewritten under the same name
    (``last.ckpt``) counts again. A name saved but not written yet (an asynchronous save) is not a file under that name
    yet: it is found at a later call.
    """
    found: dict[str, tuple[Any, str]] = {}
    last = getattr(checkpoint_callback, "last_model_path", "")
    if last:
        found[last] = (getattr(checkpoint_callback, "current_score", None), "latest")
    best = getattr(checkpoint_callback, "best_model_path", "")
    if best:
        found[best] = (getattr(checkpoint_callback, "best_model_score", None), "best")
    for path, score in dict(getattr(checkpoint_callback, "best_k_models", {})).items():
        found[path] = (score, "best_k")
    files = []
    for path, (score, tag) in found.items():
        try:
            if not os.path.isfile(path):
                continue
            mtime = os.stat(path).st_mtime
        except OSError:  # removed in between
            continue
        if logged.get(path, -1.0) < mtime:
            files.append((mtime, path, score, tag))
    return sorted(files, key=lambda entry: (entry[0], entry[1]))


__all__ = [
    "checkpoints_to_log",
    "add_prefix",
    "convert_params",
    "flatten_dict",
    "sanitize_callable_params",
    "to_json_values",
    "to_scalar",
]
