"""The abstract ``Logger`` interface and the version-folder logic shared by the file loggers."""

from __future__ import annotations

import argparse
import os
import re
from abc import ABC, abstractmethod
from functools import wraps
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from phalanx.utilities.messages import reject_class, shown
from phalanx.utilities.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from torch import nn

    from phalanx.callbacks.model_checkpoint import ModelCheckpoint

_T = TypeVar("_T")

_VERSION_DIR = re.compile(r"^version_(\d+)$")
# Created in the version folder of an fsspec URL to claim it (see ``_claim_url_version``).
_CLAIM_MARKER = ".phalanx-version"


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

    def log_graph(self, model: nn.Module, input_array: Any = None) -> None:
        """Record the model's graph (at the start of fit, unless forward runs collectives); a no-op by default."""

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """Called on every rank once a checkpoint of ``checkpoint_callback`` is complete on disk; a no-op by default."""

    def shared_state(self) -> dict[str, Any]:
        """On global rank 0 at the start of each stage: what the other ranks adopt to name the same run (picklable)."""
        return {}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """On the other ranks: take over rank 0's ``shared_state()`` (its version or run id); a no-op by default."""

    def worker_state(self) -> dict[str, Any]:
        """What global rank 0's copy hands back to the main process after a spawned or forked stage (nothing here)."""
        return {}

    def load_worker_state(self, state: dict[str, Any]) -> None:
        """In the main process: take over ``worker_state()`` of rank 0's copy, so later stages log to the same run."""


class DummyExperiment:
    """What ``experiment`` returns on ranks other than 0: every attribute is a method that does nothing."""

    def nop(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return self.nop

    def __getitem__(self, index: Any) -> DummyExperiment:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def rank_zero_experiment(fn: Callable[[Any], _T]) -> Callable[[Any], _T | DummyExperiment]:
    """Decorate a logger's ``experiment`` getter: global rank 0 gets the real object, every other rank a
    :class:`DummyExperiment` (so the tracker's run is created and written by rank 0 only).

    Use it under ``@property``, as in Lightning::

        @property
        @rank_zero_experiment
        def experiment(self) -> MyClient: ...
    """

    @wraps(fn)
    def experiment(self: Any) -> _T | DummyExperiment:
        if rank_zero_only.rank != 0:
            return DummyExperiment()
        return fn(self)

    return experiment


def _is_url(path: str) -> bool:
    return "://" in path


def _next_version(root_dir: str) -> int:
    """Return one past the highest ``version_N`` folder in ``root_dir`` (0 if there is none)."""
    if _is_url(root_dir):
        return _next_url_version(root_dir)
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


def _claim_version(root_dir: str) -> int:
    """Create the first free ``version_N`` folder in ``root_dir`` and return N.

    The folder's creation is the claim: ``os.mkdir`` fails for all but one of several runs creating the same folder,
    and the others move on to N+1, so two runs started together never share a version (choosing N first and creating
    the folder at the first write, later, would let them).
    """
    if _is_url(root_dir):
        return _claim_url_version(root_dir)
    os.makedirs(root_dir, exist_ok=True)
    version = _next_version(root_dir)
    while True:
        try:
            os.mkdir(os.path.join(root_dir, f"version_{version}"))
            return version
        except FileExistsError:
            version += 1


def _next_url_version(root_dir: str) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root_dir)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    versions = []
    for entry in entries:
        match = _VERSION_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        if match and entry.get("type") == "directory":
            versions.append(int(match.group(1)))
    return max(versions) + 1 if versions else 0


def _claim_url_version(root_dir: str) -> int:
    # Object stores have no folders to create exclusively; the claim is a marker file opened in 'xb' mode, which is
    # exclusive where the file system supports it and check-then-create elsewhere (there two runs can still race).
    import fsspec

    fs, path = fsspec.core.url_to_fs(root_dir)
    fs.makedirs(path, exist_ok=True)
    version = _next_url_version(root_dir)
    while True:
        folder = f"{path.rstrip('/')}/version_{version}"
        fs.makedirs(folder, exist_ok=True)
        try:
            with fs.open(f"{folder}/{_CLAIM_MARKER}", "xb"):
                return version
        except FileExistsError:
            version += 1


class _DirectoryLogger(Logger):
    """A logger that writes under ``save_dir/name/version_N`` (shared by CSV and TensorBoard loggers).

    Without an explicit ``version``, the run claims the next free ``version_N`` by creating its folder (exclusively,
    see ``_claim_version``), so runs started together in one ``save_dir`` never share a folder. For an fsspec URL the
    claim is a marker file opened in 'xb' mode: exclusive only where the file system implements that mode so.
    """

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
        """The run's version: on first access global rank 0 claims the next free ``version_N`` by creating it."""
        # Other ranks write nothing and only compute the number, which may differ from rank 0's (a run started in
        # between claims it): the Trainer gives them rank 0's at the start of every stage (``use_version``).
        if self._version is None:
            claiming = rank_zero_only.rank == 0  # type: ignore[attr-defined]
            self._version = _claim_version(self.root_dir) if claiming else _next_version(self.root_dir)
        return self._version

    def use_version(self, version: int | str) -> None:
        """Take ``version`` as this run's (on the other ranks of a run: the one global rank 0 claimed)."""
        self._version = version

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

    def shared_state(self) -> dict[str, Any]:
        """Rank 0's version (claimed here if it was not yet): the folder every rank names."""
        return {"version": self.version}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Use rank 0's version."""
        if state.get("version") is not None:
            self.use_version(state["version"])

    def worker_state(self) -> dict[str, Any]:
        """The version rank 0 claimed (None if it never needed one) and the hyperparameters it logged."""
        return {"version": self._version, "hparams": dict(self.hparams)}

    def load_worker_state(self, state: dict[str, Any]) -> None:
        """Take over the version rank 0 claimed: later stages write to its folder instead of claiming another."""
        if self._version is None:
            self._version = state.get("version")
        self.hparams.update(state.get("hparams", {}))

    def _prefixed(self, key: str) -> str:
        """Apply the logger's prefix to a metric key."""
        return f"{self._prefix}-{key}" if self._prefix else key


class _Broadcaster(Protocol):
    is_global_zero: bool

    def broadcast(self, obj: _T, src: int = 0) -> _T: ...


def share_logger_states(loggers: list[Logger], strategy: _Broadcaster) -> None:
    """Rank 0's ``shared_state()`` of each logger, adopted by the same logger on every other rank (one broadcast).

    Called by every rank of a run when a stage starts (the Trainer) or the processes are set up (the Cohort), so
    that all ranks name one version or tracker run; every rank broadcasts, whatever loggers it has.
    """
    zero = strategy.is_global_zero
    states = strategy.broadcast([logger.shared_state() if zero else None for logger in loggers])
    if zero:
        return
    for logger, state in zip(loggers, states):
        if state is not None:
            logger.adopt_shared_state(state)


def logger_list(value: Any, *, argument: str, choices: str) -> list[Logger]:
    """``value`` (one Logger, or a list or tuple of them) as a list; a class or anything else is refused by name.

    ``argument`` is how the messages name what was passed (``logger`` for the Trainer, ``Cohort(loggers`` ...); the
    caller handles its own shortcuts (True, False, None) before, and names them in ``choices``.
    """
    listed = isinstance(value, (list, tuple))
    items = list(value) if listed else [value]
    for index, item in enumerate(items):
        name = f"{argument}[{index}]" if listed else argument
        reject_class(name, item, Logger, "", arguments="save_dir=...")
        if not isinstance(item, Logger):
            raise TypeError(f"{name}={shown(item)} (of type {type(item).__name__}) is not a Logger; pass {choices}.")
        _refuse_duplicate(items, index, argument)
    return items


def _refuse_duplicate(items: list[Logger], index: int, argument: str) -> None:
    """Refuse ``items[index]`` when an earlier item is the same logger, or writes the same files: each row would be
    written twice."""
    item = items[index]
    for earlier, other in enumerate(items[:index]):
        if other is item:
            raise ValueError(
                f"{argument}[{earlier}] and {argument}[{index}] are the same {type(item).__name__}: it would write"
                f" every row twice. Pass each logger once."
            )
        if type(other) is type(item) and isinstance(item, _DirectoryLogger) and _same_folder(other, item):
            raise ValueError(
                f"{argument}[{earlier}] and {argument}[{index}] are two {type(item).__name__}s writing to the same"
                f" folder (save_dir={item.save_dir!r}, name={item.name!r}, version={item._version!r}): every row"
                f" would be written twice. Pass one of them, or give them different names or versions."
            )


def _same_folder(a: _DirectoryLogger, b: _DirectoryLogger) -> bool:
    # Only versions given explicitly are compared: reading an automatic one would claim its folder.
    same_version = a._version is not None and a._version == b._version
    return same_version and os.path.abspath(a.root_dir) == os.path.abspath(b.root_dir)
