"""Launcher: how the processes of a job come to exist."""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from typing import Any, Callable


class Launcher(ABC):
    """Starts the other processes of a job and runs the Trainer's function in each."""

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether the launcher works from a notebook or an interactive interpreter."""

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` in every process and return the result of this process (or rank 0's)."""

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Stop the processes this launcher started."""
