"""The Lightning Fabric habits on a Cohort (one process): to_device, seed_everything, rank_zero_first, init_tensor,
num_nodes/num_devices, callbacks/call, clip_gradients' norm_type/error_if_nonfinite and load(path) without a state."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import phalanx


def _cohort(**kwargs) -> phalanx.Cohort:
    return phalanx.Cohort(strategy="single_device", accelerator="cpu", devices=1, **kwargs)


def _set_up(cohort: phalanx.Cohort) -> tuple[object, object]:
    module = nn.Linear(3, 1)
    return cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))


def test_where_and_how_many():
    cohort = _cohort()
    assert (cohort.num_nodes, cohort.num_devices) == (1, 1)


@pytest.mark.parametrize(
    "obj",
    [torch.ones(2), {"a": torch.ones(1), "b": [torch.zeros(2), 3]}, (torch.ones(1), "text"), nn.Linear(2, 2)],
)
def test_to_device_moves_tensors_and_modules_and_keeps_the_rest(obj):
    moved = _cohort().to_device(obj)
    assert type(moved) is type(obj)
    tensors = list(moved.parameters()) if isinstance(moved, nn.Module) else []
    phalanx.utilities.apply.apply_to_tensors(moved, tensors.append)
    assert tensors and all(tensor.device == torch.device("cpu") for tensor in tensors)


def test_seed_everything_seeds_like_phalanx_seed_everything():
    assert _cohort().seed_everything(5) == 5
    first = (torch.rand(1), random.random())
    phalanx.seed_everything(5)
    assert torch.equal(first[0], torch.rand(1)) and first[1] == random.random()


@pytest.mark.parametrize("local", [False, True])
def test_rank_zero_first_runs_the_block_on_one_process(local):
    ran = []
    with _cohort().rank_zero_first(local=local):
        ran.append(True)
    assert ran == [True]


def test_init_tensor_creates_in_the_precisions_dtype():
    cohort = _cohort(precision="bf16-true")
    with cohort.init_tensor():
        tensor = torch.empty(2)
    assert tensor.dtype == torch.bfloat16


class _Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_epoch_end(self, epoch: int, *, loss: float) -> None:
        self.calls.append((self.name, epoch, loss))


@pytest.mark.parametrize("as_list", [True, False])
def test_call_reaches_every_callback_that_has_the_hook_in_order(as_list):
    calls: list = []
    callbacks = [_Recorder("a", calls), object(), _Recorder("b", calls)] if as_list else _Recorder("a", calls)
    cohort = _cohort(callbacks=callbacks)
    cohort.call("on_epoch_end", 3, loss=0.5)
    cohort.call("not_a_hook_anyone_has")
    assert calls == ([("a", 3, 0.5), ("b", 3, 0.5)] if as_list else [("a", 3, 0.5)])


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: _cohort(callbacks="x"), TypeError, "object with hook methods"),
        (lambda: _cohort().call(3), TypeError, "takes a method name"),
        (lambda: _cohort().rank_zero_first(local=1).__enter__(), TypeError, "must be True or False"),
    ],
)
def test_habit_refusals(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("norm_type", "error_if_nonfinite", "error", "match"),
    [
        (1.0, False, ValueError, "2-norm only"),
        ("inf", False, ValueError, "2-norm only"),
        (2.0, "no", TypeError, "must be True or False"),
    ],
)
def test_clip_gradients_fabric_argument_refusals(norm_type, error_if_nonfinite, error, match):
    cohort = _cohort()
    model, optimizer = _set_up(cohort)
    with pytest.raises(error, match=match):
        cohort.clip_gradients(
            model, optimizer, max_norm=1.0, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )


@pytest.mark.parametrize("error_if_nonfinite", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_gradients_error_if_nonfinite(bad, error_if_nonfinite):
    cohort = _cohort()
    model, optimizer = _set_up(cohort)
    cohort.backward(model(torch.ones(1, 3)).sum() * bad)
    if error_if_nonfinite:
        with pytest.raises(RuntimeError, match="not finite"):
            cohort.clip_gradients(model, optimizer, None, 1.0, 2, True)  # Fabric's positional order
    else:
        norm = cohort.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        assert not torch.isfinite(norm)


def test_clip_gradients_with_a_finite_norm_and_error_if_nonfinite_clips():
    cohort = _cohort()
    model, optimizer = _set_up(cohort)
    cohort.backward(model(torch.full((1, 3), 100.0)).sum())
    norm = cohort.clip_gradients(model, optimizer, max_norm=0.5, error_if_nonfinite=True)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert norm > 0.5 and torch.linalg.vector_norm(grads) == pytest.approx(0.5, rel=1e-4)


def test_load_without_a_state_returns_the_saved_objects(tmp_path):
    cohort = _cohort()
    model, optimizer = _set_up(cohort)
    cohort.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "step": 7, "note": "x"})
    assert cohort.load(tmp_path / "c.ckpt") == {"step": 7, "note": "x"}
