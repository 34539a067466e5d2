"""AdvancedProfiler: Python's cProfile per action, reporting the functions each action spent its time in."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from pathlib import Path
from typing import Any

from phalanx.profilers.profiler import Profiler
from phalanx.utilities.messages import shown


class AdvancedProfiler(Profiler):
    """Records, for each action, the Python functions it called (``cProfile``), and reports them sorted by cumulative
    time.

    Only one cProfile profile runs at a time: an action started inside another pauses the outer one until it stops,
    so a function's time is counted in the innermost action only.

    Args:
        dirpath: See :class:`~phalanx.profilers.Profiler`.
        filename: See :class:`~phalanx.profilers.Profiler`.
        line_count_restriction: How many functions to report per action: an int (that many) or a float in
            [0.0, 1.0] (that fraction of them).
        dump_stats: Also write each action's raw statistics to ``{dirpath}/{stage}-{filename}-{rank}-{action}.prof``
            (readable with :mod:`pstats` or snakeviz).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        restriction = line_count_restriction
        if isinstance(restriction, bool) or not isinstance(restriction, (int, float)) or restriction < 0:
            raise ValueError(
                f"line_count_restriction={shown(restriction)} is not valid; pass an int >= 0 (a number of functions)"
                " or a float in [0.0, 1.0] (a fraction of them)."
            )
        if isinstance(restriction, float) and restriction > 1.0:
            raise ValueError(
                f"line_count_restriction={restriction} is a float above 1.0; pass a fraction in [0.0, 1.0], or an"
                " int for a number of functions."
            )
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self._running: list[str] = []  # the actions started and not stopped, innermost last

    def start(self, action_name: str) -> None:
        """Pause the running action's profile and start (or resume) ``action_name``'s."""
        if self._running:
            self.profiled_actions[self._running[-1]].disable()
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            profile = self.profiled_actions[action_name] = cProfile.Profile()
        self._running.append(action_name)
        profile.enable()

    def stop(self, action_name: str) -> None:
        """Stop ``action_name``'s profile and resume the action it was started in."""
        if action_name not in self._running:
            raise ValueError(f"AdvancedProfiler: the action {action_name!r} was stopped but never started.")
        self.profiled_actions[action_name].disable()
        del self._running[len(self._running) - 1 - self._running[::-1].index(action_name)]
        if self._running:
            self.profiled_actions[self._running[-1]].enable()

    def summary(self) -> str:
        """Per action, the functions it spent its time in, by cumulative time."""
        sections = []
        for action, profile in self.profiled_actions.items():
            if self.dump_stats:
                self._dump(action, profile)
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative")
            stats.print_stats(self.line_count_restriction)
            rank = f" rank: {self._rank}" if self._rank is not None else ""
            sections.append(f"Profile stats for: {action}{rank}\n{text.getvalue()}")
        if not sections:
            return ""
        title = f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"
        return "\n".join([title, *sections])

    def _dump(self, action: str, profile: cProfile.Profile) -> None:
        if self.dirpath is None:
            raise ValueError(
                "AdvancedProfiler(dump_stats=True) needs a directory: pass dirpath=, or run it in a Trainer."
            )
        os.makedirs(self.dirpath, exist_ok=True)
        profile.dump_stats(os.path.join(self.dirpath, self._prepare_filename(action_name=action, extension=".prof")))

    def teardown(self, stage: str | None) -> None:
        """Close the report and drop the recorded profiles (the next stage starts afresh)."""
        super().teardown(stage)
        for action in self._running:
            self.profiled_actions[action].disable()
        self._running = []
        self.profiled_actions = {}

    def __getstate__(self) -> dict[str, Any]:
        # cProfile profiles cannot be pickled: a spawned worker starts with none.
        state = super().__getstate__()
        state["profiled_actions"], state["_running"] = {}, []
        return state


__all__ = ["AdvancedProfiler"]
