"""The abstract ``Logger`` interface and the version-folder logic shared by the file loggers."""

from __future__ import annotations

import argparse
import numbers
import os
import re
from abc import ABC, abstractmethod
from typing import Any

_VERSION_DIR = re.compile(r"^version_(\d+)$")


class Logger(ABC):
    """Base class of experiment loggers: receives metrics and hyperparameters from the Trainer."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The experiment name (a folder level for file-based loggers)."""

    @property
    @abstractmethod
    def version(self) -> int | str:
        """The experiment version: an integer (``version_N`` folder) or a folder name."""

    @property
    def save_dir(self) -> str | None:
        """The top directory the logger writes under, or None if it writes no local files."""
        return None

    @property
    def root_dir(self) -> str | None:
        """``save_dir/name``: the folder that holds all versions of this experiment, or None."""
        return None

    @property
    def log_dir(self) -> str | None:
        """``root_dir/version_N``: the folder of this run's files, or None."""
        return None

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar ``metrics`` (numbers or 0-dim tensors) at ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        """Record the run's hyperparameters."""

    def save(self) -> None:
        """Flush buffered data to storage; a no-op by default."""

    def finalize(self, status: str) -> None:
        """Close the run; ``status`` is "success", "failed" or "interrupted". Saves by default."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Hook called after the checkpoint callback saved a checkpoint; a no-op by default."""


def _next_version(root_dir: str) -> int:
    """Return one past the highest ``version_N`` folder in ``root_dir`` (0 if there is none)."""
    try:
        entries = os.listdir(root_dir)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    versions = []
    for entry in entries:
        match = _VERSION_DIR.match(entry)
        if match and os.path.isdir(os.path.join(root_dir, entry)):
            versions.append(int(match.group(1)))
    return max(versions) + 1 if versions else 0


def _to_scalar(key: str, value: Any) -> int | float:
    """Turn a metric value (number, numpy scalar, one-element tensor) into a Python number."""
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


def _to_dict(params: dict[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """Return hyperparameters as a plain dict (Namespaces, nested ones included, become dicts)."""
    if isinstance(params, argparse.Namespace):
        params = vars(params)
    if not isinstance(params, dict):
        raise TypeError(f"Hyperparameters must be a dict or argparse.Namespace, got {type(params).__name__}.")
    return {
        key: _to_dict(value) if isinstance(value, argparse.Namespace) else value for key, value in params.items()
    }


class _DirectoryLogger(Logger):
    """A logger that writes under ``save_dir/name/version_N`` (shared by CSV and TensorBoard loggers)."""

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "logs",
        version: int | str | None = None,
        prefix: str = "",
    ) -> None:
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"`save_dir` must be a str or os.PathLike, got {type(save_dir).__name__}.")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a str or None, got {type(name).__name__}.")
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, (int, str)):
                raise TypeError(f"`version` must be an int, a str or None, got {type(version).__name__}.")
            if isinstance(version, int) and version < 0:
                raise ValueError(f"`version` must be >= 0, got {version}.")
            if isinstance(version, str) and not version:
                raise ValueError("`version` must not be an empty string.")
        if not isinstance(prefix, str):
            raise TypeError(f"`prefix` must be a str, got {type(prefix).__name__}.")
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self.hparams: dict[str, Any] = {}

    @property
    def name(self) -> str:
        """The experiment name ("" when there is no name level)."""
        return self._name

    @property
    def version(self) -> int | str:
        """The run's version, picked as the next free ``version_N`` on first access and then fixed."""
        if self._version is None:
            self._version = _next_version(self.root_dir)
        return self._version

    @property
    def save_dir(self) -> str:
        """The top directory given at construction."""
        return self._save_dir

    @property
    def root_dir(self) -> str:
        """``save_dir/name`` (just ``save_dir`` when the name is empty)."""
        return os.path.join(self._save_dir, self._name) if self._name else self._save_dir

    @property
    def log_dir(self) -> str:
        """``root_dir/version_N``, or ``root_dir/<version>`` for a str version."""
        version = self.version
        folder = version if isinstance(version, str) else f"version_{version}"
        return os.path.join(self.root_dir, folder)

    def _prefixed(self, key: str) -> str:
        """Apply the logger's prefix to a metric key."""
        return f"{self._prefix}-{key}" if self._prefix else key
