"""The bounded state download without a swarm: stand-ins for hivemind's optimizer, its averagers and its retry loop
(which retries any exception without end), so that every outcome is checked in milliseconds."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from phalanx_hivemind import SwarmStateError
from phalanx_hivemind import download as download_module
from phalanx_hivemind.download import bound_state_download

TIMEOUT = 0.3


class FakeOptimizer:
    """hivemind.Optimizer's shape: ``load_state_from_peers`` loops until the averagers' downloads return."""

    def __init__(self, outcome: str, swarm_epoch: int = 5) -> None:
        self.local_epoch = 0
        self.tracker = SimpleNamespace(global_epoch=swarm_epoch)
        self.calls = 0

        def state_download(**kwargs):
            self.calls += 1
            assert 0 < kwargs["timeout"] <= TIMEOUT + 0.5  # each try fits in what is left of the deadline
            if outcome == "raises":
                raise TimeoutError("no answer")
            if outcome == "succeeds" or (outcome == "succeeds_late" and self.calls >= 3):
                self.local_epoch = swarm_epoch
            return None

        self.state_averager = SimpleNamespace(load_state_from_peers=state_download)
        self.grad_averager = SimpleNamespace(load_state_from_peers=lambda **kwargs: None)

    def load_state_from_peers(self, **kwargs):
        for _ in range(2000):  # hivemind's own loop (`while True`): only KeyboardInterrupt leaves it
            try:
                self.state_averager.load_state_from_peers(timeout=60.0)
                self.grad_averager.load_state_from_peers(timeout=60.0)
                break
            except BaseException:
                continue
        else:
            raise AssertionError("the download was retried 2000 times: it is not bounded")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(download_module, "RETRY_PAUSE", 0.05)


@pytest.mark.parametrize(
    ("outcome", "require_state", "error"),
    [
        ("raises", False, "last problem: TimeoutError: no answer"),  # would loop forever in hivemind
        ("raises", True, "last problem: TimeoutError: no answer"),
        ("nothing", True, "last problem: no peer sent a state at the swarm's step"),  # peers listed but gone
        ("nothing", False, None),  # during training hivemind goes on and tries again at its next step
        ("succeeds", True, None),
        ("succeeds_late", True, None),  # retried within the deadline
    ],
)
def test_a_download_ends_within_its_timeout(outcome: str, require_state: bool, error: str | None) -> None:
    optimizer = FakeOptimizer(outcome)
    bound_state_download(optimizer, TIMEOUT)
    started = time.monotonic()
    if error is None:
        optimizer.load_state_from_peers(require_state=require_state)
    else:
        with pytest.raises(
            SwarmStateError, match=r"load_state_timeout=0.3s \(the swarm is at step 5, this peer at 0; "
        ):
            optimizer.load_state_from_peers(require_state=require_state)
        with pytest.raises(SwarmStateError, match=error):
            optimizer.load_state_from_peers(require_state=require_state)  # the deadline is per download
    assert time.monotonic() - started < 2 * (TIMEOUT + 0.5)


def test_a_peer_one_step_behind_that_hivemind_catches_up_is_not_an_error() -> None:
    optimizer = FakeOptimizer("raises", swarm_epoch=1)
    inner = optimizer.load_state_from_peers

    def hivemind_catching_up(**kwargs):
        inner(**kwargs)
        optimizer.local_epoch = optimizer.tracker.global_epoch  # hivemind: one step behind counts itself on

    optimizer.load_state_from_peers = hivemind_catching_up
    bound_state_download(optimizer, TIMEOUT)
    optimizer.load_state_from_peers()  # no error: the swarm just stepped, nothing is lost
