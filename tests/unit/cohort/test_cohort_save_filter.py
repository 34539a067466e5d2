"""``Cohort.save(path, state, filter=...)`` (Fabric's): per state key, ``(name, value) -> bool`` selects the entries of
that object's state dict that are saved; what it cannot select is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.strategies import SingleDeviceStrategy


class _OneEngineStrategy(SingleDeviceStrategy):
    """Like DeepSpeed: one engine from the module and its optimizers, which writes the weights itself."""

    @property
    def wraps_module_with_optimizers(self) -> bool:
        return True


def _set_up(strategy: Any = "single_device") -> tuple[phalanx.Cohort, dict[str, Any]]:
    cohort = phalanx.Cohort(accelerator="cpu", strategy=strategy)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    notes = {"seen": 3, "skipped": 1}
    return cohort, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "notes": notes, "epoch": 1}


@pytest.mark.parametrize(
    ("state_filter", "weights", "notes", "scheduler_keys"),
    [
        (None, {"0.weight", "0.bias", "1.weight", "1.bias"}, {"seen", "skipped"}, None),
        ({"model": lambda name, value: name.startswith("1.")}, {"1.weight", "1.bias"}, {"seen", "skipped"}, None),
        ({"model": lambda name, value: value.dim() == 2}, {"0.weight", "1.weight"}, {"seen", "skipped"}, None),
        ({"notes": lambda name, value: name == "seen"}, {"0.weight", "0.bias", "1.weight", "1.bias"}, {"seen"}, None),
        (
            {"scheduler": lambda name, value: name == "last_epoch", "model": lambda *_: False},
            set(),
            None,
            {"last_epoch"},
        ),
    ],
)
def test_the_filter_selects_the_saved_entries_of_each_state_dict(
    tmp_path, state_filter, weights, notes, scheduler_keys
):
    cohort, state = _set_up()
    cohort.save(tmp_path / "filtered.ckpt", state, filter=state_filter)
    checkpoint = cohort.strategy.load_checkpoint(tmp_path / "filtered.ckpt")
    assert set(checkpoint["state_dict"]) == weights
    objects = checkpoint["cohort"]["objects"]
    assert set(objects["notes"]) == (notes if notes is not None else {"seen", "skipped"})
    assert objects["epoch"] == 1
    everything = set(state["scheduler"].state_dict())
    assert set(objects["scheduler"]) == (scheduler_keys if scheduler_keys is not None else everything)
    assert len(checkpoint["optimizer_states"]) == 1  # the optimizer is saved whole


def test_a_filtered_module_checkpoint_loads_with_strict_false(tmp_path):
    cohort, state = _set_up()
    model = state["model"]
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    cohort.save(tmp_path / "head.ckpt", {"model": model}, filter={"model": lambda name, _: name.startswith("1.")})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    cohort.load(tmp_path / "head.ckpt", {"model": model}, strict=False)
    now = model.state_dict()
    assert all(torch.equal(now[name], saved[name]) for name in ("1.weight", "1.bias"))
    assert all(torch.equal(now[name], saved[name] + 1.0) for name in ("0.weight", "0.bias"))  # not in the file


@pytest.mark.parametrize(
    ("state_filter", "error", "message"),
    [
        (lambda name, value: True, TypeError, r"takes a dict of state key -> callable\(name, value\) -> bool"),
        ({"weights": lambda *_: True}, ValueError, r"filter\['weights'\] names no entry of the state; the state holds"),
        ({"model": "1."}, TypeError, r"filter\['model'\] must be a callable\(name, value\) -> bool, got str"),
        ({"optimizer": lambda *_: True}, ValueError, r"filter\['optimizer'\] names an optimizer, whose state is saved"),
        ({"epoch": lambda *_: True}, ValueError, r"state\['epoch'\] is of type int; filter modules, dicts and objects"),
    ],
)
def test_filters_that_select_nothing_meaningful_are_refused(tmp_path, state_filter, error, message):
    cohort, state = _set_up()
    with pytest.raises(error, match=message):
        cohort.save(tmp_path / "refused.ckpt", state, filter=state_filter)
    assert not (tmp_path / "refused.ckpt").exists()


def test_module_entries_are_not_filtered_where_the_engine_writes_the_weights(tmp_path):
    cohort, state = _set_up(_OneEngineStrategy(device=torch.device("cpu")))
    with pytest.raises(ValueError, match=r"cannot select module entries on _OneEngineStrategy: its engine writes"):
        cohort.save(tmp_path / "refused.ckpt", state, filter={"model": lambda *_: True})
    cohort.save(tmp_path / "notes.ckpt", state, filter={"notes": lambda name, _: name == "seen"})  # the rest is fine
