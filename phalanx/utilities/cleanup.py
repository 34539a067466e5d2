"""Running every step of a clean-up even when some fail, and keeping every failure in the error that is raised."""

from __future__ import annotations

import traceback
from functools import partial
from typing import Any, Callable, Iterable

#: One clean-up step: how a message names it (e.g. ``CSVLogger.finalize('success')``) and the call that does it.
Step = tuple[str, Callable[[], Any]]


def method_calls(objects: Iterable[Any], method: str, *args: Any) -> list[Step]:
    """The call ``obj.method(*args)`` of each object as a step, named ``Type.method(args)``."""
    shown_args = ", ".join(repr(arg) for arg in args)
    return [(f"{type(obj).__name__}.{method}({shown_args})", partial(getattr(obj, method), *args)) for obj in objects]


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (``BaseException.add_note`` where Python has it: 3.11 and later)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10 prints no notes, but keeps them where 3.11 would: in ``__notes__``
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def run_every(steps: Iterable[Step], handling: BaseException | None = None) -> None:
    """Run every step, also after one raised; then report the failures.

    Outside error handling (``handling`` None) the first failure is raised, with a note on it for each later one.
    While handling an error (``handling``, which the caller raises again afterwards) that error stays the one raised:
    every failure becomes a note on it, so that a clean-up never hides why the run stopped.
    """
    failures: list[tuple[str, BaseException]] = []
    for name, call in steps:
        try:
            call()
        except BaseException as error:  # KeyboardInterrupt too: the remaining steps still run, then it is raised
            failures.append((name, error))
    if not failures:
        return
    first = handling if handling is not None else failures[0][1]
    for name, error in failures:
        if error is not first:
            add_note(first, f"{name} also raised {type(error).__name__}: {error}{_where(error)}")
    if handling is None:
        raise first


__all__ = ["Step", "add_note", "method_calls", "run_every"]
