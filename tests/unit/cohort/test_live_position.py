"""The Cohort's live position (what ``ddp_ft`` sends a joining group) travels with the Cohort where the Cohort goes:
pickled to spawned processes (``Cohort.launch`` with ``spawn``) and deep-copied, without copying the Cohort itself."""

from __future__ import annotations

import copy
import pickle

import pytest

import phalanx


def _cohort() -> phalanx.Cohort:
    cohort = phalanx.Cohort(accelerator="cpu", devices=1)
    cohort._live.position.update({"step": 3, "epoch": 1})
    cohort._optimizer_steps = 5
    return cohort


def test_a_pickled_cohort_keeps_its_position_pointing_at_itself():
    restored = pickle.loads(pickle.dumps(_cohort()))
    assert restored._live.read() == {"global_step": 5, "step": 3, "epoch": 1}
    restored._live.load({"global_step": 9, "step": 4, "unknown": 1})
    assert (restored._optimizer_steps, restored._live.position) == (9, {"step": 4, "epoch": 1})


@pytest.mark.parametrize("how", ["deepcopy of the position", "deepcopy of a holder"])
def test_a_deep_copy_shares_the_cohort_weakly_and_copies_the_counters(how):
    cohort = _cohort()
    copied = (
        copy.deepcopy(cohort._live)
        if how == "deepcopy of the position"
        else copy.deepcopy({"live": cohort._live})["live"]
    )
    assert copied is not cohort._live and copied._cohort() is cohort
    copied.position["step"] = 99
    assert cohort._live.position["step"] == 3
    assert copied.read()["global_step"] == 5
