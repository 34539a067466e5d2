"""``Cohort.save`` / ``Cohort.load`` of a plain module and optimizers before ``setup``, as Fabric allows: the file has
the Cohort's layout, loads back before and after ``setup``, and a loop resumed from it ends where Fabric's ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.utilities.exceptions import CheckpointError


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _trained(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain module and an Adam that has state (trained without any driver)."""
    net = _net(seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.full((2, 3), float(step))
        optimizer.zero_grad()
        net(x).pow(2).mean().backward()
        optimizer.step()
    return net, optimizer


def _cohort() -> phalanx.Cohort:
    return phalanx.Cohort(accelerator="cpu", devices=1)


def _weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in net.state_dict().items()}


def _same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left["param_groups"] == right["param_groups"] and all(
        torch.equal(left["state"][i][k], right["state"][i][k]) for i in left["state"] for k in left["state"][i]
    )


def test_a_plain_module_and_optimizer_round_trip_before_setup(tmp_path: Path) -> None:
    net, optimizer = _trained(0)
    _cohort().save(tmp_path / "plain.ckpt", {"model": net, "optimizer": optimizer, "epoch": 3, "note": "hi"})
    fresh, fresh_optimizer = _net(1), None
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    state: dict[str, Any] = {"model": fresh, "optimizer": fresh_optimizer, "epoch": 0}
    remaining = _cohort().load(tmp_path / "plain.ckpt", state)
    assert remaining == {"note": "hi"} and state["epoch"] == 3
    assert all(torch.equal(a, b) for a, b in zip(_weights(net).values(), _weights(fresh).values()))
    assert _same_optimizer_state(optimizer, fresh_optimizer)
    checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert checkpoint["cohort"] == {
        "module": "model",
        "optimizers": {"optimizer": 0},
        "objects": {"epoch": 3, "note": "hi"},
    }
    assert set(checkpoint["state_dict"]) == set(net.state_dict()) and len(checkpoint["optimizer_states"]) == 1


def _resume(tmp_path: Path, driver: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """Save before setup, load into fresh objects before setup, set up, train ``steps`` steps: the final weights."""
    net, optimizer = _trained(0)
    fresh = _net(1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    if driver == "fabric":
        fabric_module = pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
        make = lambda: fabric_module.Fabric(accelerator="cpu", devices=1)  # noqa: E731
    else:
        make = _cohort
    make().save(tmp_path / f"{driver}.ckpt", {"model": net, "optimizer": optimizer})
    runner = make()
    runner.load(tmp_path / f"{driver}.ckpt", {"model": fresh, "optimizer": fresh_optimizer})
    model, set_up = runner.setup(fresh, fresh_optimizer)
    for step in range(steps):
        set_up.zero_grad()
        runner.backward(model(torch.full((2, 3), float(step + 2))).pow(2).mean())
        set_up.step()
    return _weights(fresh)


def test_a_loop_resumed_from_a_save_before_setup_ends_where_fabrics_ends(tmp_path: Path) -> None:
    ours, theirs = _resume(tmp_path, "cohort"), _resume(tmp_path, "fabric")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_file_saved_before_setup_loads_after_setup_and_the_other_way(tmp_path: Path) -> None:
    net, optimizer = _trained(0)
    _cohort().save(tmp_path / "before.ckpt", {"model": net, "optimizer": optimizer})
    cohort = _cohort()
    fresh = _net(1)
    model, set_up = cohort.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    cohort.load(tmp_path / "before.ckpt", {"model": model, "optimizer": set_up})
    assert all(torch.equal(a, b) for a, b in zip(_weights(net).values(), _weights(fresh).values()))
    assert _same_optimizer_state(optimizer, set_up.optimizer)
    cohort.save(tmp_path / "after.ckpt", {"model": model, "optimizer": set_up})
    plain = _net(2)
    _cohort().load(tmp_path / "after.ckpt", {"model": plain})
    assert all(torch.equal(a, b) for a, b in zip(_weights(net).values(), _weights(plain).values()))


def _save(tmp_path: Path, state: dict[str, Any]) -> None:
    _cohort().save(tmp_path / "bad.ckpt", state)


@pytest.mark.parametrize(
    ("state", "error", "text"),
    [
        ({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)}, ValueError, "are both modules; one Cohort runs one module"),
        ({"epoch": 1}, ValueError, "the state holds no module; add the plain module"),
        ([nn.Linear(1, 1)], TypeError, "state must be a dict with str keys"),
    ],
    ids=["two-modules", "no-module", "not-a-dict"],
)
def test_a_state_that_cannot_be_saved_before_setup_is_refused(tmp_path, state, error, text):
    with pytest.raises(error, match=text):
        _save(tmp_path, state)
    assert not (tmp_path / "bad.ckpt").exists()


def test_loading_before_setup_refuses_a_directory_and_missing_optimizer_states(tmp_path: Path) -> None:
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="is a sharded checkpoint .* call cohort.setup"):
        _cohort().load(tmp_path / "sharded.ckpt", {"model": _net(0)})
    _cohort().save(tmp_path / "weights.ckpt", {"model": _net(0)})
    net = _net(1)
    with pytest.raises(CheckpointError, match="holds no optimizer states"):
        _cohort().load(tmp_path / "weights.ckpt", {"model": net, "optimizer": torch.optim.SGD(net.parameters(), 0.1)})
