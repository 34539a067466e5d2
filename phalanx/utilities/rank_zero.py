"""Helpers that act only on the process of global rank 0."""

from __future__ import annotations

import logging
import os
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


def rank_zero_only(fn: _F) -> _F:
    """Decorate ``fn`` so that it runs only on global rank 0 and returns None elsewhere."""

    @wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if rank_zero_only.rank == 0:
            return fn(*args, **kwargs)
        return None

    return wrapped  # type: ignore[return-value]


rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


def set_global_rank(rank: int) -> None:
    """Record this process's global rank for the rank-zero helpers (called by strategies)."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]


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
