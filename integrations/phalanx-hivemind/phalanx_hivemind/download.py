"""State downloads from the swarm, bounded in time and keeping the LR schedule (wrappers around hivemind's own).

hivemind's ``Optimizer.load_state_from_peers`` retries a download that raised without end: a peer that joins a swarm
whose other peers have left (their progress and addresses still in the DHT for a while) would wait forever. The
wrappers here give the whole download one deadline (``load_state_timeout``); a peer still behind the swarm then ends
with ``SwarmStateError`` naming what happened. A peer joining with its own initial weights (``require_state=True``)
also retries downloads that brought no state, and must get one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("phalanx_hivemind")

#: Seconds between two download attempts when no peer offered its state (its entry may not be in the DHT yet).
RETRY_PAUSE = 0.5


class SwarmStateError(RuntimeError):
    """This peer could not download the swarm's state from any peer within ``load_state_timeout``."""


def bound_state_download(optimizer: Any, timeout: float) -> None:
    """Make ``optimizer.load_state_from_peers`` (a ``hivemind.Optimizer``'s) end within about ``timeout`` seconds:
    successful, or behind the swarm and raising ``SwarmStateError``."""
    attempt = _Attempts(timeout)

    def still_behind() -> str | None:
        # Only a joining peer retries a download that brought no state: during training hivemind goes on (and tries
        # again at its next step), and itself catches up one step without a download (a step the swarm just took).
        if attempt.strict and optimizer.tracker.global_epoch > optimizer.local_epoch:
            refused = getattr(optimizer.state_averager, "last_refusals", None)
            if refused:  # what the checks of trust.py refused, peer by peer
                return "no peer sent an acceptable state at the swarm's step; refused: " + "; ".join(refused)
            return "no peer sent a state at the swarm's step"
        return None

    averager = optimizer.state_averager
    averager.load_state_from_peers = attempt.wrap(averager.load_state_from_peers, still_behind)
    if getattr(optimizer, "grad_averager", None) is not None:
        grads = optimizer.grad_averager
        grads.load_state_from_peers = attempt.wrap(grads.load_state_from_peers, lambda: None, record=False)
    download = optimizer.load_state_from_peers

    def load_state_from_peers(*, require_state: bool = False, **kwargs: Any) -> None:
        # require_state: a peer joining with its own initial weights; hivemind would let it count itself one step on
        # without any state when the download fails, and step with weights nobody else has.
        attempt.start(strict=require_state)
        if hasattr(averager, "last_refusals"):
            averager.last_refusals = []  # what the guarded averager refused during this download, peer by peer
        download(**kwargs)
        behind = optimizer.tracker.global_epoch - optimizer.local_epoch
        if attempt.failed and (behind > 0 or require_state):
            raise SwarmStateError(
                f"hivemind: no peer sent the swarm's state within load_state_timeout={timeout:g}s (the swarm is at"
                f" step {optimizer.tracker.global_epoch}, this peer at {optimizer.local_epoch}; last problem:"
                f" {attempt.failed}). The peers may have left the swarm: check initial_peers and run_id, raise"
                " load_state_timeout, or start without initial_peers to begin a new swarm."
            )

    optimizer.load_state_from_peers = load_state_from_peers


class _Attempts:
    """One deadline for every averager's download in one ``load_state_from_peers`` call."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.failed: str | None = None
        self.strict = False  # a download must reach the swarm's step itself (hivemind may not catch up one step)

    def start(self, strict: bool) -> None:
        self.deadline = time.monotonic() + self.timeout
        self.failed, self.strict = None, strict

    def wrap(self, download: Any, check: Any, record: bool = True) -> Any:
        """``download`` retried until ``check()`` (a problem or None) passes or the deadline; never raises.
        ``record``: its outcome is the download's (the gradient buffers' download is optional: only logged)."""

        def bounded(**kwargs: Any) -> Any:
            # hivemind's caller retries any exception without end: a failure is recorded for it instead.
            while True:
                remaining = self.deadline - time.monotonic()
                kwargs["timeout"] = max(0.5, min(kwargs.get("timeout") or remaining, remaining))
                try:
                    result = download(**kwargs)
                    problem = check()
                except Exception as error:  # hivemind raises many kinds (timeouts, p2p errors, a closed pipe)
                    result, problem = None, f"{type(error).__name__}: {error}"
                if problem is None:
                    self.failed = None if record else self.failed
                    return result
                if time.monotonic() + RETRY_PAUSE >= self.deadline:
                    if record:
                        self.failed = problem
                    return None
                log.info("hivemind: state download failed (%s); retrying until load_state_timeout", problem)
                time.sleep(RETRY_PAUSE)

        return bounded


def refresh_swarm_progress(tracker: Any, timeout: float) -> bool:
    """Have hivemind's progress tracker read the swarm's progress from the DHT now, and wait for that read (at most
    ``timeout`` seconds); True once it is in.

    The tracker reads in the background, every 0.5 to 10 seconds (``min_refresh_period``, ``max_refresh_period``) and
    only when its own schedule says so: what it holds when a peer takes its first step may be older than the set-up
    that came before (callbacks, data loading). hivemind judges whether the peer is in step with the swarm from it.
    """
    from hivemind.utils import get_dht_time  # optional: hivemind is imported only when a run starts

    # Under the tracker's lock no read is under way: the event set after this comes from a read begun after it.
    with tracker.pause_updates():
        tracker.fetched_global_progress_this_epoch.clear()
        tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()  # wakes the reader, which finds its next read due now
    return tracker.fetched_global_progress_this_epoch.wait(timeout)


def keep_schedule_on_download(averager: Any) -> None:
    """After a state download, move the LR scheduler's counters to the downloaded step without stepping it.

    hivemind steps the scheduler until it reaches the downloaded step, but the downloaded optimizer state already
    holds the peer's learning rate: a chainable scheduler (StepLR, ExponentialLR, ...) would apply its decay twice.
    """
    download = averager.load_state_from_peers

    def download_keeping_schedule(**kwargs: Any) -> Any:
        scheduler, averager.scheduler = averager.scheduler, None
        try:
            return download(**kwargs)
        finally:
            averager.scheduler = scheduler
            if scheduler is not None and scheduler.last_epoch < averager.local_epoch:
                scheduler.last_epoch = averager.local_epoch
                scheduler._step_count = averager.local_epoch + 1
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    averager.load_state_from_peers = download_keeping_schedule
