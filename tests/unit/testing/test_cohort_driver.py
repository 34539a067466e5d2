"""The conformance kit's Cohort driver in this process, on one device: the loop, its save / load / resume, and the
judges, on a correct strategy and on strategies that break what the Cohort relies on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from phalanx.strategies import SingleDeviceStrategy
from phalanx.testing.cohort_driver import EXPECTED_COHORT_LIFECYCLE, judge_cohort_lifecycle, run_loop
from phalanx.testing.training import SAVE_AT, STEPS, judge_checkpoint


def _first_and_resumed(make: Any, tmp_path: Path) -> tuple[Any, Any]:
    checkpoint = tmp_path / "mid.ckpt"
    first = run_loop(make, 1, seed=0, record=True, save_at=SAVE_AT, checkpoint=checkpoint)
    resumed = run_loop(make, 1, seed=1, resume_from=checkpoint)
    return first, resumed


def test_a_correct_strategy_passes_the_lifecycle_and_resumes_bitwise(tmp_path):
    first, resumed = _first_and_resumed(SingleDeviceStrategy, tmp_path)
    judge_cohort_lifecycle(first, rank=0, processes=1)
    judge_checkpoint(first, resumed, atol=0.0)
    assert (
        tuple(first.lifecycle.events) == EXPECTED_COHORT_LIFECYCLE and len(EXPECTED_COHORT_LIFECYCLE) == 3 + 2 * STEPS
    )
    assert first.saved is not None and resumed.started is not None
    assert resumed.label.startswith("the Cohort loop resumed with cohort.load(")


class SetsUpTwice(SingleDeviceStrategy):
    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.setup_environment()
        super().setup(*args, **kwargs)


class ForgetsWeights(SingleDeviceStrategy):
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Ignores the saved weights."""


class RaisesInBackward(SingleDeviceStrategy):
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no backward today")


def test_a_strategy_that_sets_up_twice_fails_the_lifecycle_naming_the_call(tmp_path):
    first, _ = _first_and_resumed(SetsUpTwice, tmp_path)
    with pytest.raises(AssertionError, match="by the Cohort loop: call #2 was 'setup_environment', expected 'setup'"):
        judge_cohort_lifecycle(first, rank=0, processes=1)


def test_a_strategy_that_forgets_the_saved_weights_fails_the_checkpoint_check(tmp_path):
    first, resumed = _first_and_resumed(ForgetsWeights, tmp_path)
    with pytest.raises(AssertionError, match=r"after loading the checkpoint, module_state_dict\(\) differs"):
        judge_checkpoint(first, resumed, atol=0.0)


def test_a_loop_that_raises_is_reported_with_the_error(tmp_path):
    run = run_loop(RaisesInBackward, 1, seed=0, record=True)
    assert isinstance(run.error, RuntimeError)
    with pytest.raises(AssertionError, match="the Cohort loop raised RuntimeError: no backward today"):
        judge_cohort_lifecycle(run, rank=0, processes=1)
