"""Profiler: the base of the profilers, which time named actions and write a report per stage and per rank.

A profiler is given to ``Trainer(profiler=...)`` (or named: "simple", "advanced", "pytorch"). The Trainer calls
:meth:`Profiler.setup` as each stage (fit, validate, test, predict) starts, wraps the hooks and the strategy's steps in
:meth:`Profiler.profile` while it runs, and calls :meth:`Profiler.describe` when the stage ends: the report goes to
``dirpath/filename`` (one file per stage and rank) or, without a ``filename``, to standard output on rank 0.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable

from phalanx.utilities.messages import shown

# Characters that are unsafe in a file name on some platform become '_' in report and trace names.
_UNSAFE = re.compile(r"[\\/:*?\"<>|\s]+")


class Profiler(ABC):
    """Times named actions; subclass it and define :meth:`start`, :meth:`stop` and :meth:`summary` for your own.

    Args:
        dirpath: The directory of the report (and of the traces a profiler writes). None: the Trainer's ``log_dir``
            once a stage starts (the first logger's directory, else ``default_root_dir``).
        filename: The report's file name without extension. The report of each stage and rank goes to
            ``{dirpath}/{stage}-{filename}[-{rank}].txt`` (the rank only with several processes), appended to when
            it exists. None: the report is printed on rank 0 and no file is written.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        if dirpath is not None and not isinstance(dirpath, (str, Path)):
            raise TypeError(f"dirpath={shown(dirpath)} is not valid; pass a directory as a str or Path, or None.")
        if filename is not None and not isinstance(filename, str):
            raise TypeError(f"filename={shown(filename)} is not valid; pass a file name as a str, or None.")
        self.dirpath = dirpath
        self.filename = filename
        self._stage: str | None = None
        self._rank: int | None = None
        self._output: IO[str] | None = None

    # ------------------------------------------------------------------ what a profiler defines
    @abstractmethod
    def start(self, action_name: str) -> None:
        """Start timing ``action_name``."""

    @abstractmethod
    def stop(self, action_name: str) -> None:
        """Stop timing ``action_name`` and record what was measured."""

    def summary(self) -> str:
        """The report of what was recorded since :meth:`setup` ("" when there is nothing to report)."""
        return ""

    @contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """Time the code inside ``with profiler.profile(action_name):``; it works from module and callback code
        whatever the Trainer's profiler (``trainer.profiler`` is a :class:`PassThroughProfiler` when none is set)."""
        self.start(action_name)
        try:
            yield action_name
        finally:
            self.stop(action_name)

    # ------------------------------------------------------------------ the Trainer's calls
    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Called as a stage starts: its name, the rank to report for (the global rank; None in a run of one
        process) and the directory to report to when ``dirpath`` is None."""
        self._stage = stage
        self._rank = local_rank
        if self.dirpath is None and log_dir is not None:
            self.dirpath = log_dir

    def describe(self) -> None:
        """Write the report (see :meth:`summary`) to its file, or print it on rank 0; then :meth:`teardown`."""
        try:
            report = self.summary()
            if report:
                self._write(report)
        finally:
            self.teardown(self._stage)

    def teardown(self, stage: str | None) -> None:
        """Close the report file; called after :meth:`describe` and when a stage fails."""
        output, self._output = self._output, None
        if output is not None:
            output.close()

    @property
    def local_rank(self) -> int:
        """The rank this profiler reports for (0 in a run of one process)."""
        return 0 if self._rank is None else self._rank

    # ------------------------------------------------------------------ files
    def _prepare_filename(self, action_name: str | None = None, extension: str = ".txt") -> str:
        """``{stage}-{filename}-{rank}-{action_name}{extension}`` with the parts that are set, safe as a file name."""
        parts = [self._stage, self.filename, None if self._rank is None else str(self._rank), action_name]
        base = "-".join(part for part in parts if part)
        base = _UNSAFE.sub("_", base).strip("_") or "profile"
        return base + extension

    def _write(self, text: str) -> None:
        if self.filename is None or self.dirpath is None:
            if self.local_rank == 0:
                print(text)
            return
        if self._output is None:
            os.makedirs(self.dirpath, exist_ok=True)
            self._output = open(os.path.join(self.dirpath, self._prepare_filename()), "a", encoding="utf-8")
        self._output.write(text)
        self._output.flush()

    def _attach(self, module: Any, stage_steps: Callable[[], int | float]) -> None:
        """Called by the Trainer after :meth:`setup` when the profiler records: the module being run, and how to
        count the steps the stage will take once its data is known (for profilers that follow the steps)."""

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker gets the profiler without the open report file, which cannot travel between processes.
        state = dict(self.__dict__)
        state["_output"] = None
        return state


class PassThroughProfiler(Profiler):
    """The profiler of a Trainer given none: records nothing, so ``trainer.profiler.profile(...)`` costs almost
    nothing."""

    def start(self, action_name: str) -> None:
        """Record nothing."""

    def stop(self, action_name: str) -> None:
        """Record nothing."""


__all__ = ["PassThroughProfiler", "Profiler"]
