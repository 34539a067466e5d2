"""The position of a hand-written loop that the Cohort hands a strategy healing (re)joining processes from a peer."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from phalanx.cohort.cohort import Cohort


def check_position(position: Any) -> dict[str, int]:
    """Refuse a ``start_training(position)`` that is not a dict of integer counters by name."""
    if position is None:
        return {}
    if not isinstance(position, dict):
        raise TypeError(
            f"Cohort.start_training(position) takes a dict of the loop's integer counters, e.g. {{'step': 0}}, or"
            f" None, got {type(position).__name__}."
        )
    wrong = [key for key, value in position.items() if not isinstance(key, str) or type(value) is not int]
    if wrong:
        raise ValueError(
            f"Cohort.start_training(position): {wrong} must be names (str) of integer counters, e.g. {{'step': 0}}."
        )
    if "global_step" in position:
        raise ValueError(
            "Cohort.start_training(position) may not name 'global_step': cohort.global_step is sent with it already."
        )
    return position


class LivePosition:
    """The loop's counters that the user registered (``Cohort.start_training``), with the Cohort's ``global_step``:
    what a healthy process sends a joining one, and where a joining one writes what it received."""

    def __init__(self, cohort: Cohort) -> None:
        # Weak: the strategy keeps these methods in its RunSettings, and a deep copy of the module must not reach
        # the Cohort (its last loss is no graph leaf: torch cannot copy it).
        self._cohort: Callable[[], Cohort | None] = weakref.ref(cohort)
        self.position: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        """The counters as they stand now (read by the strategy when a peer asks for them)."""
        cohort = self._cohort()
        return {"global_step": 0 if cohort is None else cohort._optimizer_steps, **self.position}

    def load(self, received: Mapping[str, int]) -> None:
        """Take a healthy peer's counters into the user's dict (in place: the loop reads them from there)."""
        received = dict(received)
        step = received.pop("global_step", None)
        cohort = self._cohort()
        if cohort is not None and isinstance(step, int):
            cohort._optimizer_steps = step
        self.position.update({key: value for key, value in received.items() if key in self.position})

    def __deepcopy__(self, memo: dict[int, Any]) -> LivePosition:
        # A copy keeps pointing at the same Cohort, weakly (see __init__): copying it would copy the Cohort.
        copied = LivePosition.__new__(LivePosition)
        copied._cohort, copied.position = self._cohort, dict(self.position)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference cannot be pickled; spawned processes receive the Cohort pickled, this with it. The Cohort
        # goes in strongly here (pickle's memo makes it the same object as the one being pickled).
        return {"cohort": self._cohort(), "position": self.position}

    def __setstate__(self, state: dict[str, Any]) -> None:
        cohort = state["cohort"]
        self._cohort = weakref.ref(cohort) if cohort is not None else _gone
        self.position = state["position"]


def _gone() -> None:
    """What a weak reference returns once its Cohort is gone (a Cohort pickled after it was collected)."""
    return None
