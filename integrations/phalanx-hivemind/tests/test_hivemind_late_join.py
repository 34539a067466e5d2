"""A peer joining a swarm that has progressed takes its first step with the swarm's state, never with its own.

HivemindStrategy reads the swarm's progress from the DHT afresh right before a fit's first batch (the Trainer) or
first step (a phalanx.Cohort loop) and, when the swarm is ahead, downloads its state first, each within
``load_state_timeout``. The strategy's decision is checked with stand-ins for hivemind's optimizer and progress tracker
(whose reading may be older than the peer's set-up, as hivemind's is); the fresh reading itself with hivemind's real
ProgressTracker on a DHT in this process. The swarm as a whole: test_hivemind_strategy.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

hivemind = pytest.importorskip(
    "hivemind", reason="phalanx-hivemind's tests need hivemind (pip install ./integrations/phalanx-hivemind)"
)
import torch  # noqa: E402
from hivemind.optim.progress_tracker import ProgressTracker  # noqa: E402
from phalanx_hivemind import HivemindStrategy, SwarmStateError  # noqa: E402
from phalanx_hivemind.download import refresh_swarm_progress  # noqa: E402

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]
BOUND = 2.0  # load_state_timeout of the stand-in runs: each wait here ends within it


class FakeTracker:
    """hivemind's ProgressTracker as far as the strategy uses it: a reading of the swarm's progress (``seen``) made in
    the past, and a background reader that reads the DHT (``swarm``) when its schedule, or a nudge, says so."""

    def __init__(self, seen: int, swarm: int, answers: bool = True) -> None:
        self.swarm, self.answers = swarm, answers
        self.global_progress = SimpleNamespace(
            epoch=seen, samples_accumulated=0, num_peers=2, next_fetch_time=float("inf")
        )
        self.local_progress = SimpleNamespace(samples_accumulated=0)
        self.lock = threading.Lock()
        self.fetched_global_progress_this_epoch = threading.Event()
        self.fetched_global_progress_this_epoch.set()  # the past reading
        self.global_state_updated = threading.Event()
        self.stopped = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @property
    def global_epoch(self) -> int:
        return self.global_progress.epoch

    @contextlib.contextmanager
    def pause_updates(self):
        with self.lock:
            yield

    def _read(self) -> None:
        while not self.stopped:
            if self.global_state_updated.wait(0.05):
                self.global_state_updated.clear()
            if self.answers and time.time() >= self.global_progress.next_fetch_time:
                with self.lock:
                    self.global_progress.epoch = self.swarm
                    self.global_progress.next_fetch_time = float("inf")
                    self.fetched_global_progress_this_epoch.set()

    def report_local_progress(self, epoch: int, samples: int) -> None:
        self.reported = epoch


class FakeOptimizer(torch.optim.SGD):
    """A hivemind.Optimizer stand-in: its state download brings the swarm's step (or fails), ``step`` is recorded."""

    def __init__(self, tracker: FakeTracker, local_epoch: int, download_fails: bool) -> None:
        super().__init__([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        self.tracker, self.download_fails = tracker, download_fails
        self.state_averager = SimpleNamespace(local_epoch=local_epoch)
        self.events: list[str] = []

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    def load_state_from_peers(self, require_state: bool = False) -> None:
        self.events.append(f"download(require_state={require_state})")
        if self.download_fails:
            raise SwarmStateError("no peer sent the swarm's state")
        self.state_averager.local_epoch = self.tracker.global_epoch

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        self.events.append("step")
        return closure() if closure is not None else None


# Each row: this peer's step, its resumed step (None: not resumed), the step the tracker last read (possibly long ago),
# the swarm's step in the DHT now, whether the DHT answers, whether the download fails; then what happens before the
# first step (a download or not) or the error raised.
ROWS = [
    ("joins a swarm ahead, read stale", 0, None, 0, 5, True, False, "download", None),
    ("joins a swarm ahead, read fresh", 0, None, 5, 5, True, False, "download", None),
    ("starts with the swarm", 0, None, 0, 0, True, False, "no download", None),
    ("resumed at the swarm's step", 0, 5, 0, 5, True, False, "no download", None),
    ("resumed behind the swarm", 0, 3, 3, 5, True, False, "download", None),
    ("resumed ahead of a new swarm", 0, 7, 0, 2, True, False, "no download", None),
    ("the DHT does not answer", 0, None, 0, 5, False, False, None, "could not read the swarm's progress"),
    ("no peer serves its state", 0, None, 0, 5, True, True, None, "no peer sent the swarm's state"),
]


def _strategy(row: tuple) -> tuple[HivemindStrategy, FakeOptimizer]:
    _, local, resumed, seen, swarm, answers, download_fails, _, _ = row
    strategy = HivemindStrategy(target_batch_size=16, batch_size=8, load_state_timeout=BOUND, log_progress=False)
    optimizer = FakeOptimizer(FakeTracker(seen, swarm, answers), local, download_fails)
    strategy._hivemind_optimizer = optimizer
    strategy._restored_epoch = resumed
    return strategy, optimizer


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
@pytest.mark.parametrize("driver", ["trainer", "cohort"])
def test_the_first_step_is_taken_with_the_swarms_state(row: tuple, driver: str) -> None:
    strategy, optimizer = _strategy(row)
    expected, error = row[-2], row[-1]
    closure = lambda: torch.tensor(1.0)  # noqa: E731
    try:
        with pytest.raises(SwarmStateError, match=error) if error else contextlib.nullcontext():
            if driver == "trainer":  # the Trainer's hooks, in its order, around the first batch
                strategy.on_train_start()
                time.sleep(0.2)  # the peer's own on_train_start hooks (the swarm may move meanwhile)
                strategy.on_train_batch_start((torch.zeros(8, 1),), 0)
            strategy.optimizer_step(optimizer, closure)
    finally:
        optimizer.tracker.stopped = True
    if error:
        return
    downloads = [event for event in optimizer.events if event.startswith("download")]
    assert optimizer.local_epoch >= row[4] or expected == "no download"
    if expected == "download":
        assert downloads == ["download(require_state=True)"]  # strict: a state must come
        # The Trainer downloads before the batch is computed and steps; a Cohort loop computed its gradients on the
        # old parameters and drops them.
        assert optimizer.events[-1] == ("step" if driver == "trainer" else downloads[-1])
    else:
        assert not downloads and optimizer.events == ["step"]
    if row[2] is not None:
        assert optimizer.tracker.reported == row[2]  # the resumed step was told to the swarm


def test_the_swarm_is_read_again_for_every_fit() -> None:
    strategy, optimizer = _strategy(ROWS[0])
    try:
        for _ in range(2):
            strategy.on_train_start()
            strategy.on_train_batch_start((torch.zeros(8, 1),), 0)
            strategy.optimizer_step(optimizer, lambda: None)
            strategy.on_train_batch_start((torch.zeros(8, 1),), 1)  # later batches: nothing read
            optimizer.tracker.swarm += 5
    finally:
        optimizer.tracker.stopped = True
    assert [event for event in optimizer.events if event.startswith("download")] == ["download(require_state=True)"] * 2


def test_hiveminds_tracker_reads_the_swarm_when_asked() -> None:
    """hivemind's own ProgressTracker (refreshing once every 1000 s here) holds a stale reading until asked."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    slow = dict(min_refresh_period=1000, max_refresh_period=1000, default_refresh_period=1000)
    reader = ProgressTracker(dht, "late_join", 100, start=True, **slow)
    writer = ProgressTracker(dht, "late_join", 100, start=True, **slow)
    try:
        writer.report_local_progress(7, 10)  # another peer, at step 7
        deadline = time.monotonic() + 30
        while dht.get("late_join_progress", latest=True) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reader.global_epoch == 0  # what the reader last read
        assert refresh_swarm_progress(reader, timeout=30.0)
        assert reader.global_epoch == 7
    finally:
        reader.shutdown()
        writer.shutdown()
        dht.shutdown()
