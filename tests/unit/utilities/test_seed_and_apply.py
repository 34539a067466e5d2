"""Seeding, capturing and restoring RNG states, and applying functions to tensors in nested containers."""

from __future__ import annotations

import io
import random
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from phalanx.utilities.apply import apply_to_tensors, move_to_device
from phalanx.utilities.seed import collect_rng_states, restore_rng_states, seed_everything, worker_init_fn

_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PHALANX_GLOBAL_SEED", "PHALANX_SEED_WORKERS", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _clean_seed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # seed_everything writes these variables: setenv first so that monkeypatch restores the original state.
    for name in _SEED_VARIABLES:
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def _draws() -> tuple[list[float], float, list[float]]:
    return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()


# ------------------------------------------------------------------ seed_everything


def test_seed_everything_returns_the_seed_and_makes_all_generators_reproducible() -> None:
    assert seed_everything(1234) == 1234
    first = _draws()
    assert seed_everything(1234) == 1234
    assert _draws() == first
    seed_everything(4321)
    assert _draws() != first


def test_seed_everything_exports_the_seed_for_worker_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    seed_everything(7, workers=True)
    assert os.environ["PHALANX_GLOBAL_SEED"] == os.environ["PL_GLOBAL_SEED"] == "7"
    assert os.environ["PHALANX_SEED_WORKERS"] == os.environ["PL_SEED_WORKERS"] == "1"
    seed_everything(8)
    assert os.environ["PHALANX_SEED_WORKERS"] == os.environ["PL_SEED_WORKERS"] == "0"


@pytest.mark.parametrize("variable", ["PL_GLOBAL_SEED", "PHALANX_GLOBAL_SEED"])
def test_seed_everything_without_a_seed_reads_the_environment(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "99")
    assert seed_everything() == 99


def test_seed_everything_without_a_seed_or_environment_seeds_zero_and_warns() -> None:
    with pytest.warns(UserWarning, match="No seed found, seed set to 0"):
        assert seed_everything() == 0
    first = _draws()
    seed_everything(0)
    assert _draws() == first


@pytest.mark.parametrize("variable", ["PL_GLOBAL_SEED", "PHALANX_GLOBAL_SEED"])
def test_a_seed_variable_that_is_no_number_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "forty-two")
    with pytest.raises(ValueError, match=f"{variable}='forty-two' is not a valid seed"):
        seed_everything()


@pytest.mark.parametrize("seed", [-1, 2**32, 10**20])
def test_seed_everything_rejects_out_of_range_seeds(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be in \[0, 4294967295\]"):
        seed_everything(seed)


@pytest.mark.parametrize("seed", [1.5, "3", True])
def test_seed_everything_rejects_non_int_seeds(seed: Any) -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        seed_everything(seed)


def test_seed_everything_boundary_seeds_are_accepted() -> None:
    assert seed_everything(0) == 0
    assert seed_everything(2**32 - 1) == 2**32 - 1


# ------------------------------------------------------------------ worker seeds


def _worker_draws(base_seed: int, worker_id: int, rank: int) -> tuple:
    torch.manual_seed(base_seed + worker_id)  # what torch's DataLoader does in each worker before worker_init_fn
    worker_init_fn(worker_id, rank)
    return _draws()


def test_worker_init_fn_is_reproducible_and_differs_per_worker_and_rank() -> None:
    draws = {(worker, rank): _worker_draws(1000, worker, rank) for worker in range(3) for rank in range(2)}
    assert draws[(1, 1)] == _worker_draws(1000, 1, 1)  # reproducible
    flattened = [value for draw in draws.values() for value in (tuple(draw[0]), draw[1], tuple(draw[2]))]
    assert len(set(flattened)) == len(flattened)  # every worker/rank, and every generator within one, differs
    assert _worker_draws(2000, 0, 0) != draws[(0, 0)]  # a new epoch (new base seed) gives new streams


# ------------------------------------------------------------------ RNG state capture


def test_collect_and_restore_rng_states_reproduces_torch_python_and_numpy() -> None:
    seed_everything(5)
    _draws()  # move away from a freshly seeded state
    random.gauss(0, 1)  # python's generator caches the second gaussian: part of the state
    states = collect_rng_states()
    assert set(states) >= {"torch", "python", "numpy"}
    expected = _draws() + (random.gauss(0, 1),)
    seed_everything(6)
    restore_rng_states(states)
    assert _draws() + (random.gauss(0, 1),) == expected


def test_collected_rng_states_survive_torch_save_and_weights_only_load() -> None:
    seed_everything(11)
    states = collect_rng_states()
    expected = _draws()
    buffer = io.BytesIO()
    torch.save({"rng_states": states}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng_states"]
    _draws()
    restore_rng_states(loaded)
    assert _draws() == expected


def test_collected_rng_states_are_snapshots() -> None:
    states = collect_rng_states()
    before = states["torch"].clone()
    torch.rand(10)
    assert torch.equal(states["torch"], before)


# ------------------------------------------------------------------ apply_to_tensors / move_to_device


Pair = namedtuple("Pair", ["first", "second"])


class _TupleSubclass(tuple):
    pass


def test_apply_to_tensors_preserves_container_types_and_leaves_other_values() -> None:
    data = {
        "list": [torch.ones(1), 2],
        "tuple": (torch.ones(1), "x"),
        "named": Pair(torch.ones(1), None),
        "ordered": OrderedDict([("b", torch.ones(1)), ("a", torch.ones(1))]),
        "default": defaultdict(list, {"k": torch.ones(1)}),
        "sub": _TupleSubclass([torch.ones(1)]),
        "nested": [{"deep": (torch.ones(1),)}],
        "plain": 3.5,
    }
    out = apply_to_tensors(data, lambda t: t * 2)
    assert type(out) is dict
    assert type(out["list"]) is list and out["list"][0].item() == 2 and out["list"][1] == 2
    assert type(out["tuple"]) is tuple and out["tuple"][1] == "x"
    assert type(out["named"]) is Pair and out["named"].first.item() == 2 and out["named"].second is None
    assert type(out["ordered"]) is OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert type(out["default"]) is defaultdict and out["default"].default_factory is list
    assert out["default"]["k"].item() == 2
    assert type(out["sub"]) is _TupleSubclass and out["sub"][0].item() == 2
    assert out["nested"][0]["deep"][0].item() == 2
    assert out["plain"] == 3.5
    assert data["list"][0].item() == 1  # the input is not modified


def test_apply_to_tensors_on_a_bare_tensor() -> None:
    assert apply_to_tensors(torch.ones(2), lambda t: t.sum()).item() == 2


def test_move_to_device_moves_every_tensor_and_keeps_containers() -> None:
    data = {"x": [torch.ones(2)], "y": Pair(torch.zeros(1, dtype=torch.int64), "label")}
    moved = move_to_device(data, torch.device("meta"))
    assert moved["x"][0].device.type == "meta"
    assert type(moved["y"]) is Pair and moved["y"].first.device.type == "meta" and moved["y"].first.dtype == torch.int64
    assert moved["y"].second == "label"


def test_move_to_device_on_cpu_keeps_cpu_tensors_as_they_are() -> None:
    tensor = torch.ones(2)
    moved = move_to_device([tensor, {"t": tensor}], torch.device("cpu"))
    assert moved[0] is tensor and moved[1]["t"] is tensor


# ------------------------------------------------------------------ the XLA generator
class _FakeXla:
    """Stands in for torch_xla in sys.modules: a runtime that is running or not, and one device generator."""

    def __init__(self, running: bool) -> None:
        import types

        self.running, self.seed, self.calls = running, 123, []
        self.module = types.ModuleType("torch_xla")
        self.module._XLAC = types.SimpleNamespace(_xla_runtime_is_initialized=lambda: self.running)
        self.xla_model = types.ModuleType("torch_xla.core.xla_model")
        self.xla_model.get_rng_state = self._get
        self.xla_model.set_rng_state = self._set
        self.core = types.ModuleType("torch_xla.core")
        self.core.xla_model = self.xla_model
        self.module.core = self.core

    def _get(self) -> int:
        self.calls.append("get")
        return self.seed

    def _set(self, seed: int) -> None:
        self.calls.append(("set", seed))
        self.seed = seed

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import sys

        monkeypatch.setitem(sys.modules, "torch_xla", self.module)
        monkeypatch.setitem(sys.modules, "torch_xla.core", self.core)
        monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", self.xla_model)


@pytest.mark.parametrize("running", [True, False])
def test_the_xla_generator_is_saved_and_restored_only_where_xla_already_runs(monkeypatch, running):
    fake = _FakeXla(running)
    fake.install(monkeypatch)
    states = collect_rng_states()
    assert states.get("xla") == (123 if running else None)
    fake.seed = 999  # training draws on
    restore_rng_states({**collect_rng_states(), "xla": 77})
    # Without a running runtime, torch_xla is not even asked: asking would start it and block its launcher later.
    assert fake.calls == (["get", "get", ("set", 77)] if running else [])
    assert fake.seed == (77 if running else 999)


def test_a_checkpoint_with_an_xla_generator_restores_where_torch_xla_is_absent(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)
    states = {**collect_rng_states(), "xla": 5}
    torch.manual_seed(0)
    restore_rng_states(states)  # the CPU generators come back; the XLA entry is left alone
    assert torch.equal(torch.get_rng_state(), states["torch"]) and "torch_xla" not in sys.modules
