"""HivemindStrategy at the edges of a swarm, in this process: a joiner whose peers have left ends with a clear error
within ``load_state_timeout`` (hivemind alone would retry forever), and a user's own loop (``phalanx.Cohort``) trains.

A bare DHT started here stands for the swarm's bootstrap node; one real peer (phalanx_hivemind_peer.py) trains on it
and is killed, leaving its progress and its averager's entry in the DHT for the joiner to find.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

hivemind = pytest.importorskip(
    "hivemind", reason="phalanx-hivemind's tests need hivemind (pip install ./integrations/phalanx-hivemind)"
)
import torch  # noqa: E402
from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.dht.schema import SchemaValidator  # noqa: E402
from hivemind.optim.progress_tracker import TrainingProgressSchema  # noqa: E402
from phalanx_hivemind import HivemindStrategy, SwarmStateError  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402

PEER_SCRIPT = Path(__file__).with_name("phalanx_hivemind_peer.py")
LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]
WAIT_SECONDS = 90


class Tiny(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


def _data() -> TensorDataset:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


@pytest.fixture
def bootstrap():
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    # hivemind's progress records, readable here as on every peer (what hivemind's ProgressTracker registers).
    dht.add_validators([SchemaValidator(TrainingProgressSchema, prefix="left"), RSASignatureValidator()])
    try:
        yield dht
    finally:
        dht.shutdown()


def _swarm_step_in_dht(dht: Any) -> int:
    """The highest step a peer of run 'left' reported to the DHT (-1 before any)."""
    found = dht.get("left_progress", latest=True)
    entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
    return max((entry.value["epoch"] for entry in entries if entry.value is not None), default=-1)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _peer_that_trains_then_dies(workdir: Path, dht: Any, steps: int) -> int:
    """Start a real peer on the DHT, wait until it took ``steps`` swarm steps and told the DHT so (it reports in the
    background: a kill right after its step can leave an older step there), kill it (with its p2pd); its step."""
    initial_peers = ",".join(str(address) for address in dht.get_visible_maddrs())
    command = [sys.executable, str(PEER_SCRIPT), "--name", "gone", "--out", str(workdir), "--run-id", "left"]
    command += ["--initial-peers", initial_peers, "--target-batch-size", "32", "--matchmaking-time", "1"]
    command += ["--max-seconds", str(WAIT_SECONDS)]
    log = (workdir / "gone.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + WAIT_SECONDS
    try:
        while True:
            reached = [r["epoch"] for r in _records(workdir / "gone.jsonl") if "params" in r]
            if reached and max(reached) >= steps and _swarm_step_in_dht(dht) >= steps:
                return _swarm_step_in_dht(dht)
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "gone.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"the first peer did not reach swarm step {steps} (exit {process.poll()}):\n{tail}")
            time.sleep(0.2)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def test_a_joiner_whose_peers_left_ends_with_a_clear_error(tmp_path: Path, bootstrap: Any) -> None:
    reached = _peer_that_trains_then_dies(tmp_path, bootstrap, steps=3)
    strategy = HivemindStrategy(
        target_batch_size=32,
        run_id="left",
        initial_peers=[str(address) for address in bootstrap.get_visible_maddrs()],
        host_maddrs=LOCALHOST,
        matchmaking_time=2.0,
        load_state_timeout=5.0,
    )
    trainer = phalanx.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    started = time.monotonic()
    try:
        expected = r"load_state_timeout=5s \(the swarm is at step \d+, this peer at \d+; last problem"
        with pytest.raises(SwarmStateError, match=expected):
            trainer.fit(Tiny(), DataLoader(_data(), batch_size=8))
    finally:
        strategy.teardown()
    elapsed = time.monotonic() - started
    # The swarm's step (from the dead peer's progress, still in the DHT) and a bound: reading the swarm's progress and
    # the download (each within the timeout) plus start-up costs.
    assert reached >= 3
    assert elapsed < 2 * 5.0 + 30.0, f"the failed download took {elapsed:.1f}s"


def test_a_users_own_loop_trains_with_cohort(tmp_path: Path) -> None:
    strategy = HivemindStrategy(
        target_batch_size=16, batch_size=8, run_id="cohort", host_maddrs=LOCALHOST, matchmaking_time=0.5
    )
    cohort = phalanx.Cohort(accelerator="cpu", strategy=strategy)
    try:
        module = Tiny()
        model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5))
        assert strategy.hivemind_optimizer is not None  # the user's optimizer now steps with the swarm
        loader = cohort.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=True))
        losses = []
        for _ in range(3):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                cohort.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
        # 16 samples per swarm step, 8 per batch: one swarm step every two batches (a swarm of one).
        assert strategy.swarm_progress.epoch >= len(losses) // 2 - 2
        assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), losses
    finally:
        strategy.teardown()


def test_cohort_setup_module_is_refused_with_the_reason() -> None:
    cohort = phalanx.Cohort(accelerator="cpu", strategy=HivemindStrategy(target_batch_size=16, host_maddrs=LOCALHOST))
    try:
        with pytest.raises(RuntimeError, match=r"HivemindStrategy .*call cohort.setup\(module, optimizer\)"):
            cohort.setup_module(Tiny())
    finally:
        cohort.strategy.teardown()


def test_cohort_without_batch_size_names_the_argument() -> None:
    strategy = HivemindStrategy(target_batch_size=16, host_maddrs=LOCALHOST, matchmaking_time=0.5)
    cohort = phalanx.Cohort(accelerator="cpu", strategy=strategy)
    try:
        module = Tiny()
        model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        cohort.backward(model(torch.randn(8, 8)).sum())
        with pytest.raises(ValueError, match=r"phalanx.Cohort loop\); pass HivemindStrategy\(batch_size=\.\.\.\)"):
            optimizer.step()
    finally:
        strategy.teardown()
