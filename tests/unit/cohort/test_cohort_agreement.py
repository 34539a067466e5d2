"""The agreement of collective Cohort calls (phalanx/cohort/agreement.py), its ranks played by threads sharing one
in-memory store: what every rank raises when ranks disagree, stop coming or exit, how long each waits, and that the
store's keys stay bounded. Real processes: tests/distributed/test_collective_guard.py."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch.distributed as dist

from phalanx.cohort.agreement import AGREEMENT_TIMEOUT_ENV, Agreement, agreement_timeout, describe_module

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

THREAD_BOUND = 60.0  # the longest any test waits for its ranks; the waits under test are seconds
NEVER = 600.0  # a wait that must not happen: a rank that waited this long would outlive THREAD_BOUND and fail the test


def _ranks(world_size: int, store: Any = None) -> list[Agreement]:
    store = dist.HashStore() if store is None else store
    return [Agreement(lambda: store, rank, world_size) for rank in range(world_size)]


def _run(ranks: list[Agreement], calls: Callable[[Agreement], Any]) -> list[Any]:
    """Run ``calls(agreement)`` on a thread per rank; each rank's result, or the exception it raised."""
    results: list[Any] = [None] * len(ranks)

    def play(index: int) -> None:
        try:
            results[index] = calls(ranks[index])
        except Exception as error:  # recorded for the test to look at
            results[index] = error

    threads = [threading.Thread(target=play, args=(index,), daemon=True) for index in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_BOUND)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting"
    return results


def _same(method: str, **arguments: str) -> Callable[[Agreement], None]:
    return lambda rank: rank.agree(method, arguments, 5.0, "the test")


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_agree_pass_and_the_store_keys_stay_bounded(world_size):
    store = dist.HashStore()
    ranks = _ranks(world_size, store)

    def many(rank: Agreement) -> int:
        for index in range(120):
            rank.agree("barrier" if index % 2 else "broadcast", {"src": "0"}, 10.0, "the test")
        return rank.calls

    assert _run(ranks, many) == [120] * world_size
    assert store.num_keys() <= 2 * world_size + 3  # entry slots, the counter, at most two verdicts


# Each row: what rank 0 and rank 1 call (method, arguments), and what every rank's error must say.
DISAGREEMENTS = [
    pytest.param(
        ("save", {}), ("barrier", {}), ["different collective Cohort methods", "'save'", "'barrier'"], id="method"
    ),
    pytest.param(
        ("broadcast", {"src": "0"}),
        ("broadcast", {"src": "1"}),
        ["src: 0 on rank 0; 1 on rank 1", "same src"],
        id="src",
    ),
    pytest.param(
        ("save", {"path": "a.ckpt"}),
        ("save", {"path": "b.ckpt"}),
        ["path: a.ckpt on rank 0; b.ckpt on rank 1"],
        id="path",
    ),
    pytest.param(
        ("load", {"path": "a.ckpt", "checkpoint": "a file of 10 bytes, content 01"}),
        ("load", {"path": "a.ckpt", "checkpoint": "nothing at this path"}),
        ["checkpoint: a file of 10 bytes, content 01 on rank 0; nothing at this path on rank 1", "same checkpoint"],
        id="checkpoint",
    ),
    pytest.param(
        ("setup", {"module": "Net", "parameters": "2 tensors, layout aa"}),
        ("setup", {"module": "Net", "parameters": "4 tensors, layout bb"}),
        ["parameters: 2 tensors, layout aa on rank 0; 4 tensors, layout bb on rank 1", "same module"],
        id="parameters",
    ),
]


@pytest.mark.parametrize(("first", "second", "said"), DISAGREEMENTS)
def test_ranks_that_disagree_all_fail_at_once_naming_the_difference(first, second, said):
    calls = {0: first, 1: second}
    errors = _run(_ranks(2), lambda rank: rank.agree(*calls[rank.rank], NEVER, "the test"))
    assert all(isinstance(error, RuntimeError) for error in errors), errors
    assert str(errors[0]) == str(errors[1])
    for text in said:
        assert text in str(errors[0])


def test_a_disagreement_among_three_ranks_groups_the_ranks_by_value():
    sources = {0: "0", 1: "1", 2: "0"}
    errors = _run(_ranks(3), lambda rank: rank.agree("broadcast", {"src": sources[rank.rank]}, NEVER, "the test"))
    assert all("src: 0 on ranks [0, 2]; 1 on rank 1" in str(error) for error in errors), errors


def test_the_ranks_go_on_agreeing_after_a_disagreement_they_all_saw():
    def play(rank: Agreement) -> list[str]:
        seen = []
        for src in (str(rank.rank), "0", "0"):
            try:
                rank.agree("broadcast", {"src": src}, 10.0, "the test")
                seen.append("ok")
            except RuntimeError:
                seen.append("refused")
        return seen

    assert _run(_ranks(2), play) == [["refused", "ok", "ok"]] * 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_never_comes_fails_the_others_within_the_timeout_and_a_late_one_at_once(world_size):
    ranks = _ranks(world_size)
    waiting = ranks[:-1]  # the last rank does not come in time
    errors = _run(waiting, lambda rank: rank.agree("barrier", {}, 1.0, "the test's limit"))
    for error in errors:
        assert isinstance(error, RuntimeError)
        said = str(error)
        gave_up = f"rank {world_size - 1} did not reach it within 1 s" in said and "the test's limit" in said
        assert gave_up or "stopped waiting" in said, said  # the first to give up says why; others may read that
    late = _run(ranks[-1:], lambda rank: rank.agree("barrier", {}, NEVER, "the test"))[0]
    assert isinstance(late, RuntimeError) and "stopped waiting for this call" in str(late)
    assert f"because rank {world_size - 1} had not reached it in time" in str(late)


@pytest.mark.parametrize("mid_call", [False, True], ids=["between-calls", "in-a-call"])
def test_a_rank_that_exits_fails_the_others_at_once_naming_it(mid_call):
    ranks = _ranks(2)
    _run(ranks, _same("setup"))  # one call together
    if mid_call:  # rank 1 started its second call (its entry is in) and its process ended before the verdict
        ranks[1].calls += 1
    ranks[1].mark_exited()
    error = _run(ranks[:1], lambda rank: rank.agree("barrier", {}, NEVER, "the test"))[0]
    assert isinstance(error, RuntimeError)
    calls = 2 if mid_call else 1
    assert f"rank 1 (after {calls} collective Cohort call(s)) exited (its process ended)" in str(error)


@pytest.mark.parametrize("noticed", ["by-its-notice", "after-the-timeout"])
def test_a_rank_that_exited_is_named_by_every_later_call_at_once(noticed):
    ranks = _ranks(2)
    if noticed == "after-the-timeout":  # rank 0 gave up on rank 1 once; rank 1 exits later, its notice comes too late
        gave_up = _run(ranks[:1], _same("barrier"))[0]
        assert "rank 1 did not reach it" in str(gave_up)
    ranks[1].mark_exited()
    first = _run(ranks[:1], lambda rank: rank.agree("save", {}, 1.0, "the test"))[0]
    later = [
        _run(ranks[:1], lambda rank, method=method: rank.agree(method, {}, NEVER, "the test"))[0]
        for method in ("load", "setup")
    ]
    for error, method in zip([first, *later], ("save", "load", "setup")):
        assert isinstance(error, RuntimeError)
        assert f"Cohort.{method} cannot complete: rank 1 (after 0 collective Cohort call(s)) exited" in str(error)


class _LostStore:
    """A store whose host went away: every operation fails as a closed connection does."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_store_that_cannot_be_reached_is_named():
    error = _run([Agreement(_LostStore, 0, 2)], _same("save"))[0]
    assert isinstance(error, RuntimeError) and "could not reach the key-value store" in str(error)
    assert "Connection reset by peer" in str(error)


class _Strategy:
    def __init__(self, timeout: timedelta | None) -> None:
        self.collective_timeout = timeout


# Each row: the strategy's timeout= (s; None: torch's default), the environment variable, patient (barrier), and the
# wait and what it is said to be set by.
TIMEOUTS = [
    (4, None, True, 4, "the strategy's timeout= (4 s)"),
    (4, None, False, 4, "the strategy's timeout= (4 s), shorter than"),
    (None, None, True, 1800, "the strategy's timeout= (1800 s)"),
    (None, None, False, 120, "the environment variable PHALANX_COHORT_AGREEMENT_TIMEOUT (120 s)"),
    (600, "10", False, 10, "the environment variable PHALANX_COHORT_AGREEMENT_TIMEOUT (10 s)"),
    (600, "10", True, 600, "the strategy's timeout= (600 s)"),
    (4, "10", False, 4, "the strategy's timeout= (4 s), shorter than"),
]


@pytest.mark.parametrize(("given", "environment", "patient", "expected", "source"), TIMEOUTS)
def test_the_wait_honours_the_timeout_given(monkeypatch, given, environment, patient, expected, source):
    if environment is None:
        monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(AGREEMENT_TIMEOUT_ENV, environment)
    strategy = _Strategy(None if given is None else timedelta(seconds=given))
    waited, said = agreement_timeout(strategy, patient)
    assert waited == expected
    assert said.startswith(source)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf", "nan", ""])
def test_a_bad_agreement_timeout_is_refused(monkeypatch, value):
    monkeypatch.setenv(AGREEMENT_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        agreement_timeout(_Strategy(None), patient=False)


def test_modules_are_described_by_their_parameters():
    import torch

    small, large = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    assert describe_module(small) == describe_module(torch.nn.Linear(2, 2))
    assert describe_module(small)["parameters"] != describe_module(large)["parameters"]
    assert describe_module(small)["parameters"].startswith("2 tensors")
    assert describe_module(small.double())["parameters"] != describe_module(torch.nn.Linear(2, 2))["parameters"]
