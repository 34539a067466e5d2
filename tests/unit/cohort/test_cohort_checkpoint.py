"""Cohort.load and the random generators: a loop with dropout resumed from a Cohort checkpoint goes on bitwise."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.utilities.exceptions import CheckpointError

BATCHES = 4  # per epoch


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8 * BATCHES, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _set_up(shuffle: bool) -> tuple[phalanx.Cohort, nn.Module, Any, Any, Any]:
    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)
    module = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    loader = cohort.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=shuffle))
    return cohort, module, model, optimizer, loader


def _step(cohort: phalanx.Cohort, model: Any, optimizer: Any, batch: Any) -> None:
    x, y = batch
    optimizer.zero_grad()
    cohort.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _uninterrupted(shuffle: bool, epochs: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(0)
    cohort, module, model, optimizer, loader = _set_up(shuffle)
    for _ in range(epochs):
        for batch in loader:
            _step(cohort, model, optimizer, batch)
    return _weights(module)


@pytest.mark.parametrize("restore_rng", [True, False])
def test_resumed_at_an_epoch_boundary_a_loop_with_dropout_and_shuffling_goes_on_bitwise(tmp_path, restore_rng):
    straight = _uninterrupted(shuffle=True)
    torch.manual_seed(0)
    cohort, _, model, optimizer, loader = _set_up(shuffle=True)
    for batch in loader:
        _step(cohort, model, optimizer, batch)
    cohort.save(tmp_path / "epoch1.ckpt", {"model": model, "optimizer": optimizer, "epoch": 1})

    torch.manual_seed(123)  # a new process: other generator states until the load
    random.seed(123)
    cohort, module, model, optimizer, loader = _set_up(shuffle=True)
    cohort.load(tmp_path / "epoch1.ckpt", {"model": model, "optimizer": optimizer}, restore_rng=restore_rng)
    for batch in loader:  # the shuffle of epoch 2 and its dropout masks come from the restored generator
        _step(cohort, model, optimizer, batch)
    same = all(torch.equal(a, b) for a, b in zip(_weights(module), straight))
    assert same is restore_rng


def test_resumed_within_an_epoch_after_skipping_the_trained_batches_goes_on_bitwise(tmp_path):
    straight = _uninterrupted(shuffle=False, epochs=1)
    torch.manual_seed(0)
    cohort, _, model, optimizer, loader = _set_up(shuffle=False)
    for index, batch in enumerate(loader):
        if index == 2:
            break
        _step(cohort, model, optimizer, batch)
    cohort.save(tmp_path / "mid.ckpt", {"model": model, "optimizer": optimizer})

    torch.manual_seed(7)
    cohort, module, model, optimizer, loader = _set_up(shuffle=False)
    batches = iter(loader)
    for _ in range(2):  # skip the batches the checkpoint has trained on (fetching them draws, as it did)
        next(batches)
    cohort.load(tmp_path / "mid.ckpt", {"model": model, "optimizer": optimizer})
    for batch in batches:
        _step(cohort, model, optimizer, batch)
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), straight))


def test_a_checkpoint_without_generator_states_loads_and_leaves_the_generators_alone(tmp_path):
    torch.manual_seed(0)
    cohort, module, model, optimizer, _ = _set_up(shuffle=False)
    cohort.save(tmp_path / "full.ckpt", {"model": model, "optimizer": optimizer})
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=True)
    del checkpoint["rng_states"]  # as an older writer, or a hand-made checkpoint, leaves it
    torch.save(checkpoint, tmp_path / "old.ckpt")
    saved = _weights(module)

    torch.manual_seed(5)
    cohort, module, model, optimizer, _ = _set_up(shuffle=False)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    cohort.load(tmp_path / "old.ckpt", {"model": model, "optimizer": optimizer})
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), saved))


@pytest.mark.parametrize(
    ("rng_states", "match"),
    [
        ("seeds", r"checkpoint\['rng_states'\] holds str; expected a list"),
        ([{"python": [3, [0], None]}], r"\['rng_states'\]\[0\]\['torch'\] is missing"),
        ([{"torch": torch.zeros(3), "python": [3, [0], None]}], r"\['rng_states'\]\[0\]\['torch'\] holds Tensor"),
    ],
)
def test_damaged_generator_states_are_refused_before_anything_is_loaded(tmp_path, rng_states, match):
    torch.manual_seed(0)
    cohort, module, model, optimizer, _ = _set_up(shuffle=False)
    cohort.save(tmp_path / "good.ckpt", {"model": model, "optimizer": optimizer})
    checkpoint = torch.load(tmp_path / "good.ckpt", weights_only=True)
    checkpoint["rng_states"] = rng_states
    torch.save(checkpoint, tmp_path / "bad.ckpt")

    cohort, module, model, optimizer, _ = _set_up(shuffle=False)
    before, generator = _weights(module), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match):
        cohort.load(tmp_path / "bad.ckpt", {"model": model, "optimizer": optimizer})
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), before))
    assert torch.equal(torch.get_rng_state(), generator)
    cohort.load(tmp_path / "bad.ckpt", {"model": model, "optimizer": optimizer}, restore_rng=False)  # skips them
    assert not all(torch.equal(a, b) for a, b in zip(_weights(module), before))


def test_restore_rng_takes_a_bool_and_set_epoch_an_int(tmp_path):
    cohort, _, model, optimizer, loader = _set_up(shuffle=False)
    cohort.save(tmp_path / "a.ckpt", {"model": model})
    with pytest.raises(TypeError, match=r"restore_rng='yes'\) must be True or False"):
        cohort.load(tmp_path / "a.ckpt", {"model": model}, restore_rng="yes")
    with pytest.raises(ValueError, match=r"set_epoch\(epoch=-1\) takes an int >= 0"):
        loader.set_epoch(-1)
