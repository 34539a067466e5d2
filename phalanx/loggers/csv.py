"""A dependency-free logger that writes metrics to ``metrics.csv`` and hyperparameters to ``hparams.yaml``."""

from __future__ import annotations

import argparse
import csv
import json
import math
import numbers
import os
import re
from typing import Any

from phalanx.loggers.logger import _DirectoryLogger
from phalanx.loggers.utilities import convert_params, to_scalar
from phalanx.utilities.rank_zero import rank_zero_only, rank_zero_warn

HPARAMS_FILE = "hparams.yaml"
METRICS_FILE = "metrics.csv"

# Strings that a YAML reader would take for something other than a string when left unquoted.
_PLAIN_STRING = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_YAML_KEYWORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null"}


def _yaml_scalar(value: Any) -> str:
    """Format one scalar as YAML; objects that are not plain values become their quoted ``repr``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            return ".nan"
        if math.isinf(number):
            return ".inf" if number > 0 else "-.inf"
        text = repr(number)
        if "." not in text:  # "1e-05" reads back as a string in YAML 1.1 readers
            text = text.replace("e", ".0e")
        return text
    if isinstance(value, str):
        if _PLAIN_STRING.match(value) and value.lower() not in _YAML_KEYWORDS:
            return value
        return json.dumps(value)  # a JSON string is a valid YAML double-quoted string
    return json.dumps(repr(value))


def _yaml_lines(value: Any, indent: int) -> list[str]:
    """Format a non-empty dict or list as block YAML lines indented by ``indent`` spaces."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{pad}{_yaml_scalar(key)}:"
            if _is_block(item):
                lines.append(head)
                lines.extend(_yaml_lines(item, indent + 2))
            else:
                lines.append(f"{head} {_yaml_inline(item)}")
    else:
        for item in value:
            if _is_block(item):
                nested = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0].lstrip()}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_yaml_inline(item)}")
    return lines


def _is_block(value: Any) -> bool:
    """Whether ``value`` is written as an indented block (a non-empty dict, list or tuple)."""
    return isinstance(value, (dict, list, tuple)) and len(value) > 0


def _yaml_inline(value: Any) -> str:
    """Format a value that fits on one line (a scalar or an empty collection)."""
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _yaml_scalar(value)


def hparams_to_yaml(params: dict[str, Any] | argparse.Namespace) -> str:
    """Return hyperparameters as YAML text (plain values as-is, other objects as quoted reprs)."""
    params = convert_params(params)
    if not params:
        return "{}\n"
    return "\n".join(_yaml_lines(params, 0)) + "\n"


def save_hparams_to_yaml(path: str | os.PathLike, params: dict[str, Any] | argparse.Namespace) -> None:
    """Write hyperparameters to the YAML file at ``path``, creating its folder if needed."""
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        file.write(hparams_to_yaml(params))


class CSVLogger(_DirectoryLogger):
    """Log metrics to ``save_dir/name/version_N/metrics.csv`` and hyperparameters to ``hparams.yaml``.

    Rows are buffered in memory and written every ``flush_logs_every_n_steps`` calls to
    :meth:`log_metrics` and on :meth:`save` / :meth:`finalize`. Each call makes one row; its ``step``
    column holds ``step`` (or the call's index when ``step`` is None). Only global rank 0 writes.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        if isinstance(flush_logs_every_n_steps, bool) or not isinstance(flush_logs_every_n_steps, int):
            raise TypeError(
                f"`flush_logs_every_n_steps` must be an int, got {type(flush_logs_every_n_steps).__name__}."
            )
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"`flush_logs_every_n_steps` must be >= 1, got {flush_logs_every_n_steps}.")
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] = ["step"]  # union of all keys seen, in order of first appearance
        self._file_keys: list[str] | None = None  # header of metrics.csv as last written
        self._calls = 0

    @property
    def metrics_file_path(self) -> str:
        """Path of ``metrics.csv`` in :attr:`log_dir`."""
        return os.path.join(self.log_dir, METRICS_FILE)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Buffer one row of metrics (tensors are converted with ``.item()``)."""
        row: dict[str, Any] = {"step": self._calls if step is None else int(step)}
        for key, value in metrics.items():
            name = self._prefixed(str(key))
            row[name] = to_scalar(name, value)
            if name not in self._keys:
                self._keys.append(name)
        self._rows.append(row)
        self._calls += 1
        if self._calls % self._flush_every == 0:
            self.save()

    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        """Merge ``params`` into :attr:`hparams` and write them all to ``hparams.yaml``."""
        self.hparams.update(convert_params(params))
        self._write_hparams()

    @rank_zero_only
    def _write_hparams(self) -> None:
        """Write :attr:`hparams` to ``log_dir/hparams.yaml``."""
        save_hparams_to_yaml(os.path.join(self.log_dir, HPARAMS_FILE), self.hparams)

    @rank_zero_only
    def save(self) -> None:
        """Write buffered rows to ``metrics.csv``, rewriting it when the header must widen."""
        if not self._rows:
            return
        path = self.metrics_file_path
        if self._file_keys is None:
            self._file_keys = []
            if os.path.isfile(path):
                rank_zero_warn(f"{path} already exists; new rows are appended to it.")
                with open(path, newline="", encoding="utf-8") as file:
                    header = next(csv.reader(file), [])
                self._file_keys = list(header)
                self._keys = list(header) + [key for key in self._keys if key not in header]
        os.makedirs(self.log_dir, exist_ok=True)
        if self._file_keys and self._keys == self._file_keys:
            with open(path, "a", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=self._keys, restval="")
                writer.writerows(self._rows)
        else:
            old_rows: list[dict[str, str]] = []
            if self._file_keys and os.path.isfile(path):
                with open(path, newline="", encoding="utf-8") as file:
                    old_rows = list(csv.DictReader(file))
            with open(path, "w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=self._keys, restval="")
                writer.writeheader()
                writer.writerows(old_rows)
                writer.writerows(self._rows)
            self._file_keys = list(self._keys)
        self._rows = []

    def finalize(self, status: str) -> None:
        """Flush what is buffered."""
        self.save()

    def worker_state(self) -> dict[str, Any]:
        """As the base, plus the columns of the ``metrics.csv`` rank 0 wrote: later stages append to that file."""
        return {**super().worker_state(), "file_keys": self._file_keys, "keys": list(self._keys), "calls": self._calls}

    def load_worker_state(self, state: dict[str, Any]) -> None:
        """Take over rank 0's version and ``metrics.csv`` columns."""
        super().load_worker_state(state)
        if "keys" in state:
            self._file_keys, self._keys, self._calls = state["file_keys"], list(state["keys"]), state["calls"]
