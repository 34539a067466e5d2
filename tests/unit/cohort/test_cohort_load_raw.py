"""Cohort.load_raw: a plain torch.save(model.state_dict()) file into the set-up module (one process here; the sharded
strategies in tests/distributed/test_cohort_habits_processes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.utilities.exceptions import CheckpointError


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _cohort_model(empty_init: bool) -> tuple[phalanx.Cohort, nn.Module, object, object]:
    cohort = phalanx.Cohort(strategy="single_device", accelerator="cpu", devices=1)
    with cohort.init_module(empty_init=empty_init):
        module = _net()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.0))
    return cohort, module, model, optimizer


@pytest.mark.parametrize("empty_init", [False, True])
@pytest.mark.parametrize("wrapped", [True, False])
def test_load_raw_puts_the_files_weights_into_the_set_up_module(tmp_path, empty_init, wrapped):
    pretrained = _net()
    torch.save(pretrained.state_dict(), tmp_path / "raw.pt")
    cohort, module, model, optimizer = _cohort_model(empty_init)
    cohort.load_raw(tmp_path / "raw.pt", model if wrapped else module)
    optimizer.zero_grad()
    cohort.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()  # lr=0: the loaded weights stay what the file holds
    for name, value in pretrained.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=0, atol=0)


def test_load_raw_with_strict_false_leaves_missing_entries(tmp_path):
    pretrained = _net()
    partial = {key: value for key, value in pretrained.state_dict().items() if key.startswith("0.")}
    torch.save(partial, tmp_path / "partial.pt")
    cohort, module, model, _ = _cohort_model(False)
    before = module[2].weight.detach().clone()
    with pytest.raises(RuntimeError, match="Missing key"):
        cohort.load_raw(tmp_path / "partial.pt", model)
    cohort.load_raw(tmp_path / "partial.pt", model, strict=False)
    torch.testing.assert_close(module[0].weight, pretrained[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(module[2].weight, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c, m, o, p: c.load_raw(p, o), TypeError, "optimizer states travel in Cohort.save"),
        (lambda c, m, o, p: c.load_raw(p, _net()), ValueError, "module set up by this Cohort"),
        (lambda c, m, o, p: c.load_raw(3, m), TypeError, "path must be a str or os.PathLike"),
        (lambda c, m, o, p: c.load_raw(p, m, strict="yes"), TypeError, "must be True or False"),
        (lambda c, m, o, p: c.load(p, {"model": m}), CheckpointError, r"load it with cohort.load_raw\(path, model\)"),
    ],
)
def test_load_raw_refusals_and_load_pointing_at_it(tmp_path, call, error, match):
    path = tmp_path / "raw.pt"
    torch.save(_net().state_dict(), path)
    cohort, _, model, optimizer = _cohort_model(False)
    with pytest.raises(error, match=match):
        call(cohort, model, optimizer, path)


def test_load_raw_of_a_cohort_checkpoint_points_at_load(tmp_path):
    cohort, _, model, optimizer = _cohort_model(False)
    cohort.save(tmp_path / "full.ckpt", {"model": model, "optimizer": optimizer})
    with pytest.raises(CheckpointError, match=r"load it with cohort.load\(path, state\)"):
        cohort.load_raw(tmp_path / "full.ckpt", model)
