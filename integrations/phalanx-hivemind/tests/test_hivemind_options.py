"""HivemindStrategy without a swarm: discovery through the entry point, argument checks, and the pieces of a step.

Nothing here starts hivemind (no DHT, no daemon): these run in milliseconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from phalanx_hivemind import (
    INITIAL_PEERS_ENV,
    RUN_ID_ENV,
    TARGET_BATCH_SIZE_ENV,
    HivemindStrategy,
    SwarmScheduler,
)
from phalanx_hivemind.strategy import _batch_size_of

import phalanx
from phalanx.strategies import STRATEGY_REGISTRY, RunSettings
from phalanx.utilities.exceptions import CheckpointError

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWExample"


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (INITIAL_PEERS_ENV, RUN_ID_ENV, TARGET_BATCH_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)


def test_found_only_through_the_entry_point() -> None:
    assert STRATEGY_REGISTRY.get_class("hivemind") is HivemindStrategy
    assert "hivemind" in STRATEGY_REGISTRY.description("hivemind")
    # phalanx's core never imports this package; it names it only in the install hint for an unknown "hivemind".
    core = Path(phalanx.__file__).parent
    mentions = [path for path in core.rglob("*.py") if "hivemind" in path.read_text().lower()]
    assert mentions == [core / "strategies" / "registry.py"]
    hint = mentions[0].read_text()
    assert "import phalanx_hivemind" not in hint and "import hivemind" not in hint


def test_listing_the_strategies_does_not_import_hivemind() -> None:
    code = (
        "import sys; from phalanx.strategies import STRATEGY_REGISTRY;"
        "assert 'hivemind' in STRATEGY_REGISTRY.available(); import phalanx_hivemind;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hivemind'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_defaults() -> None:
    strategy = HivemindStrategy(4096)
    assert (strategy.target_batch_size, strategy.run_id, strategy.initial_peers) == (4096, "phalanx_run", [])
    assert strategy.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert (strategy.matchmaking_time, strategy.averaging_timeout, strategy.load_state_timeout) == (5.0, 30.0, 60.0)
    assert strategy.traits.handles_gradient_accumulation and strategy.is_global_zero and strategy.world_size == 1
    assert strategy.dht is None and strategy.swarm_progress is None and strategy.visible_addresses == []


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(target_batch_size=0), ValueError, "target_batch_size=0) must be an int >= 1"),
        (dict(target_batch_size=2.5), ValueError, "target_batch_size=2.5) must be an int >= 1"),
        (dict(target_batch_size=True), ValueError, "target_batch_size=True) must be an int >= 1"),
        (dict(batch_size=-1), ValueError, "batch_size=-1) must be an int >= 1"),
        (dict(average_state_every=0), ValueError, "average_state_every=0) must be an int >= 1"),
        (dict(matchmaking_time=0), ValueError, "matchmaking_time=0) must be a number of seconds > 0"),
        (dict(averaging_timeout=float("inf")), ValueError, "averaging_timeout=inf) must be a number of seconds"),
        (dict(load_state_timeout="60"), ValueError, "load_state_timeout='60') must be a number of seconds"),
        (dict(run_id=""), ValueError, "run_id='') must be a non-empty string without spaces"),
        (dict(run_id="my run"), ValueError, "run_id='my run') must be a non-empty string without spaces"),
        (dict(initial_peers=["127.0.0.1:31337"]), ValueError, "'127.0.0.1:31337', which is not a multiaddress"),
        (dict(initial_peers=31337), TypeError, "initial_peers=31337) must be a list of multiaddresses"),
        (dict(host_maddrs=["tcp/0"]), ValueError, "host_maddrs=...) holds 'tcp/0', which is not a multiaddress"),
        (dict(client_mode="yes"), TypeError, "client_mode='yes') must be True or False"),
        (dict(use_local_updates=1), TypeError, "use_local_updates=1) must be True or False"),
        (dict(grad_compression="fp16"), ValueError, "grad_compression='fp16') is not a known compression; choose"),
        (dict(state_compression=16), TypeError, "state_compression=16) must be one of ['float16', 'none'"),
        (dict(delay_optimizer_step=True), ValueError, "delay_optimizer_step=True) needs offload_optimizer=True"),
        (dict(delay_grad_averaging=True), ValueError, "delay_grad_averaging=True) needs delay_optimizer_step=True"),
        (
            dict(offload_optimizer=True, delay_optimizer_step=True),
            ValueError,
            "delay_optimizer_step=True) needs delay_state_averaging=True",
        ),
        (dict(use_local_updates=True, grad_compression="float16"), ValueError, "grad_compression has no effect"),
        (dict(device="gpu0"), ValueError, "device='gpu0', which is not a torch device"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments, error, message) -> None:
    with pytest.raises(error) as raised:
        HivemindStrategy(**{"target_batch_size": 64, **arguments})
    assert message in str(raised.value)


def test_the_missing_target_batch_size_is_named() -> None:
    with pytest.raises(ValueError, match=f"target_batch_size=... or set {TARGET_BATCH_SIZE_ENV}"):
        HivemindStrategy()


@pytest.mark.parametrize(
    ("variable", "value", "attribute", "expected"),
    [
        (TARGET_BATCH_SIZE_ENV, "512", "target_batch_size", 512),
        (INITIAL_PEERS_ENV, f"{PEER}, {PEER}2", "initial_peers", [PEER, f"{PEER}2"]),
        (RUN_ID_ENV, "albert_swarm", "run_id", "albert_swarm"),
    ],
)
def test_the_environment_fills_what_the_arguments_leave_out(monkeypatch, variable, value, attribute, expected) -> None:
    monkeypatch.setenv(TARGET_BATCH_SIZE_ENV, "64")
    monkeypatch.setenv(variable, value)
    assert getattr(HivemindStrategy(), attribute) == expected
    # An argument given in the code wins over the environment.
    explicit = {"target_batch_size": 8, "initial_peers": [f"{PEER}9"], "run_id": "mine"}[attribute]
    assert getattr(HivemindStrategy(**{attribute: explicit}), attribute) == explicit


def test_a_bad_environment_variable_is_named(monkeypatch) -> None:
    monkeypatch.setenv(TARGET_BATCH_SIZE_ENV, "lots")
    with pytest.raises(ValueError, match=f"{TARGET_BATCH_SIZE_ENV}='lots' must be an int >= 1"):
        HivemindStrategy()


def test_selected_by_name_from_the_trainer(monkeypatch) -> None:
    monkeypatch.setenv(TARGET_BATCH_SIZE_ENV, "256")
    monkeypatch.setenv(INITIAL_PEERS_ENV, PEER)
    trainer = phalanx.Trainer(strategy="hivemind", accelerator="cpu", logger=False, enable_progress_bar=False)
    strategy = trainer.strategy
    assert type(strategy) is HivemindStrategy
    assert (strategy.target_batch_size, strategy.initial_peers, strategy.root_device.type) == (256, [PEER], "cpu")
    assert strategy.dht is None  # nothing starts before fit


@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "64-true"])
def test_precisions_with_their_own_step_are_refused(precision) -> None:
    with pytest.raises(ValueError, match=rf"precision='{precision}'.*Choose one of \['32-true', 'bf16-mixed'\]"):
        phalanx.Trainer(strategy=HivemindStrategy(64), accelerator="cpu", precision=precision)


def test_accumulate_grad_batches_is_refused_before_anything_starts() -> None:
    strategy = HivemindStrategy(64)
    with pytest.raises(ValueError, match="accumulate_grad_batches=4 does not apply to HivemindStrategy"):
        strategy.setup(RunSettings(accumulate_grad_batches=4))
    assert strategy.dht is None


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (torch.zeros(8, 3), 8),
        ((torch.zeros(5, 2), torch.zeros(5)), 5),
        ({"text": ["a", "b"], "ids": torch.zeros(2, 16)}, 2),
        ([[torch.zeros(3)]], 3),
        (torch.tensor(1.0), None),
        ("a string", None),
        ({"labels": [1, 2]}, None),
    ],
)
def test_batch_size_is_read_from_the_first_batched_tensor(batch, expected) -> None:
    assert _batch_size_of(batch) == expected


def test_swarm_scheduler_lets_hivemind_step_the_schedule() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    real = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    handle = SwarmScheduler(real)
    handle.step()
    assert handle.get_last_lr() == [1.0] and handle.optimizer is optimizer
    optimizer.step()
    real.step()
    assert handle.state_dict()["last_epoch"] == 1
    handle.load_state_dict({**real.state_dict(), "last_epoch": 7})
    assert real.last_epoch == 7


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [({"epoch": -1}, "expected a dict with an int 'epoch' >= 0"), ("3", "holds '3'"), ({"run_id": "x"}, "'epoch'")],
)
def test_a_damaged_swarm_entry_is_a_checkpoint_error(tmp_path, entry, fragment) -> None:
    path = tmp_path / "damaged.ckpt"
    torch.save({"state_dict": {}, "hivemind": entry}, path)
    with pytest.raises(CheckpointError, match=fragment) as raised:
        HivemindStrategy(64).load_checkpoint(path)
    assert str(path) in str(raised.value)


def test_a_checkpoint_of_another_strategy_starts_at_swarm_step_zero(tmp_path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, path)
    strategy = HivemindStrategy(64)
    strategy.load_checkpoint(path)
    assert strategy._restored_epoch is None
