"""Launcher: how the processes of a job come to exist, and what a started worker sends back."""

from __future__ import annotations

import signal
import sys
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, runtime_checkable


def in_interactive_session() -> bool:
    """Whether Python runs interactively (a notebook, IPython, ``python -i``): there is no script to start again."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


@runtime_checkable
class WorkerState(Protocol):
    """What the driver (the Trainer, your loop) carries back from new worker processes into the process that started
    them.

    Only launchers that start the job's processes themselves (spawn, fork) use it: once ``function`` returned, the
    worker of global rank 0 calls ``collect``, and the main process, after every worker exited, ``restore``.
    """

    def collect(self) -> dict[str, Any]:
        """In the worker of global rank 0: the state to send back (plain values and tensors; moved to the CPU)."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """In the main process: take over the state that ``collect`` returned in the worker."""
        ...


class Launcher(ABC):
    """Starts the other processes of a job and runs the driver's function in each."""

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether the launcher works from a notebook or an interactive interpreter."""

    @abstractmethod
    def launch(
        self, function: Callable[..., Any], *args: Any, worker_state: WorkerState | None = None, **kwargs: Any
    ) -> Any:
        """Run ``function(*args, **kwargs)`` in every process and return the result of this process (or rank 0's)."""

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Stop the processes this launcher started."""
