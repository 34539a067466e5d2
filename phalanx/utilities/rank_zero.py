"""Helpers that act only on the process of global rank 0."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from functools import wraps
from typing import Any, Callable, TypeVar

log = logging.getLogger("phalanx")

_F = TypeVar("_F", bound=Callable[..., Any])


def _rank_from_environment() -> int:
    # Before a strategy sets the rank, the launcher's variables are the best guess (torchrun, SLURM, ...).
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


class _RankZeroOnly:
    """The ``@rank_zero_only`` decorator; ``rank_zero_only.rank`` is the global rank of this process.

    Replicas that run as threads of one process (torch_xla on its CPU runtime, TPU v2/v3 hosts) each get their own rank
    with ``use_thread_rank``; ``rank_zero_only.rank`` then reads and sets the calling thread's rank.
    """

    def __init__(self) -> None:
        self._process_rank = _rank_from_environment()
        self._threads = threading.local()

    @property
    def rank(self) -> int:
        """The calling thread's rank when it has one, else the process's."""
        return getattr(self._threads, "rank", self._process_rank)

    @rank.setter
    def rank(self, rank: int) -> None:
        if hasattr(self._threads, "rank"):
            self._threads.rank = rank
        else:
            self._process_rank = rank

    def __call__(self, fn: _F) -> _F:
        """Decorate ``fn`` so that it runs only on global rank 0 and returns None elsewhere."""

        @wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.rank == 0:
                return fn(*args, **kwargs)
            return None

        return wrapped  # type: ignore[return-value]


rank_zero_only = _RankZeroOnly()


def set_global_rank(rank: int) -> None:
    """Record this process's (or, after ``use_thread_rank``, this thread's) global rank for the rank-zero helpers."""
    rank_zero_only.rank = rank


def use_thread_rank(rank: int) -> None:
    """Give the calling thread its own global rank (for replicas that run as threads of one process)."""
    rank_zero_only._threads.rank = rank


@rank_zero_only
def rank_zero_info(message: str, *args: Any, **kwargs: Any) -> None:
    """Log ``message`` at INFO level on rank 0."""
    log.info(message, *args, **kwargs)


@rank_zero_only
def rank_zero_debug(message: str, *args: Any, **kwargs: Any) -> None:
    """Log ``message`` at DEBUG level on rank 0."""
    log.debug(message, *args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """Emit a warning on rank 0."""
    warnings.warn(message, category, stacklevel=stacklevel + 1)


@rank_zero_only
def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    """Print on rank 0."""
    print(*args, **kwargs)
