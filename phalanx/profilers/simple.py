"""SimpleProfiler: the wall-clock time of each action, its number of calls and its share of the stage."""

from __future__ import annotations

import math
import time
from pathlib import Path

from phalanx.profilers.profiler import Profiler


class SimpleProfiler(Profiler):
    """Records how long each action takes (host clock) and reports, per action, the mean duration and the total,
    sorted by total time, as Lightning's SimpleProfiler does.

    On an accelerator the host does not wait for the device's work, so an action's time is the time the host spent
    in it: a step that waits on the device (a loss read, a collective) carries the device time queued before it.

    Args:
        dirpath: See :class:`~phalanx.profilers.Profiler`.
        filename: See :class:`~phalanx.profilers.Profiler`.
        extended: Also report each action's number of calls and percentage of the stage's time (and a total row).
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, extended: bool = True) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.extended = extended
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = {}
        self.start_time = time.perf_counter()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Start a new report for ``stage`` (see :meth:`Profiler.setup`)."""
        super().setup(stage, local_rank=local_rank, log_dir=log_dir)
        self.current_actions = {}
        self.recorded_durations = {}
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        """Start timing ``action_name``; it must not be running already."""
        if action_name in self.current_actions:
            raise ValueError(f"SimpleProfiler: the action {action_name!r} was started while it was running already.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        """Record the time since ``action_name`` was started."""
        end = time.perf_counter()
        started = self.current_actions.pop(action_name, None)
        if started is None:
            raise ValueError(f"SimpleProfiler: the action {action_name!r} was stopped but never started.")
        self.recorded_durations.setdefault(action_name, []).append(end - started)

    def summary(self) -> str:
        """A table of the actions, the longest in total first."""
        if not self.recorded_durations:
            return ""
        elapsed = time.perf_counter() - self.start_time
        rows = []
        for action, durations in self.recorded_durations.items():
            total = math.fsum(durations)
            rows.append((action, total / len(durations), len(durations), total, 100.0 * total / elapsed))
        rows.sort(key=lambda row: row[3], reverse=True)
        title = f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"
        header: tuple[str, ...]
        cells: list[tuple[str, ...]]
        if self.extended:
            header = ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
            calls = sum(row[2] for row in rows)
            cells = [("Total", "-", str(calls), f"{elapsed:.5g}", "100 %")]
            cells += [(a, f"{m:.5g}", str(n), f"{t:.5g}", f"{p:.5g}") for a, m, n, t, p in rows]
        else:
            header = ("Action", "Mean duration (s)", "Total time (s)")
            cells = [(a, f"{m:.5g}", f"{t:.5g}") for a, m, _, t, _ in rows]
        return title + "\n" + _table(header, cells)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    rule = "-" * len(line(header))
    return "\n".join([rule, line(header), rule, *(line(row) for row in rows), rule]) + "\n"


__all__ = ["SimpleProfiler"]
