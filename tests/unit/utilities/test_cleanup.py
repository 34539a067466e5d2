"""``run_every`` runs every clean-up step even after one raised, then raises the first failure with the others as
notes on it, or, while an error is being handled, leaves that error the one raised with every failure as a note."""

from __future__ import annotations

import pytest

from phalanx.utilities.cleanup import method_calls, run_every


class Step:
    """A step object with a ``finish(status)`` method that records its call and raises when given an error."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.calls = error, []

    def finish(self, status: str) -> None:
        self.calls.append(status)
        if self.error is not None:
            raise self.error


#: Which of three steps fail, by index.
FAILING = [(), (0,), (1,), (2,), (0, 2), (0, 1, 2)]


@pytest.mark.parametrize("handling", [False, True], ids=["after success", "while handling an error"])
@pytest.mark.parametrize("failing", FAILING, ids=str)
def test_every_step_runs_and_the_right_error_is_raised_with_the_others_as_notes(failing, handling) -> None:
    errors = {index: OSError(f"step {index} failed") for index in failing}
    steps = [Step(errors.get(index)) for index in range(3)]
    running = ValueError("the run failed") if handling else None
    if not failing and not handling:
        run_every(method_calls(steps, "finish", "done"))
        assert [step.calls for step in steps] == [["done"]] * 3
        return
    with pytest.raises(BaseException) as raised:
        run_every(method_calls(steps, "finish", "done"), handling=running)
        raise running  # the caller raises the error it handles again
    assert [step.calls for step in steps] == [["done"]] * 3  # none skipped
    expected = list(errors.values())
    first = running if handling else expected[0]
    assert raised.value is first
    noted = expected if handling else expected[1:]
    notes = getattr(first, "__notes__", [])
    assert len(notes) == len(noted)
    for note, error in zip(notes, noted):
        assert note.startswith(f"Step.finish('done') also raised OSError: {error} (at ")


def test_a_keyboard_interrupt_in_a_step_lets_the_rest_run_then_is_raised() -> None:
    steps = [Step(KeyboardInterrupt()), Step()]
    with pytest.raises(KeyboardInterrupt):
        run_every(method_calls(steps, "finish", "x"))
    assert steps[1].calls == ["x"]
