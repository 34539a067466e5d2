"""Consolidating DeepSpeed checkpoint directories, on files written here in DeepSpeed's layouts (no deepspeed needed).

The distributed tests consolidate real DeepSpeed output; these cover the layout details one run does not reach:
several parameter groups, padding, sub-groups, frozen and shared parameters, unmappable optimizer state, and the
refusal of anything that would need arbitrary unpickling.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.plugins.io.formats.deepspeed import (
    STATE_FILE,
    is_deepspeed_checkpoint,
    load_deepspeed_checkpoint_as_full,
    read_trainer_state,
)
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

WORLD = 2


def _deepspeed_class(monkeypatch, module_name: str, cls: type) -> type:
    """Make ``cls`` pickle under DeepSpeed's name for it (a stand-in module, only while the test runs).

    Missing parent packages get stand-ins too, so that pickling never imports the real deepspeed (whose import would
    put its own module back under that name).
    """
    parts = module_name.split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(module_name)
    cls.__module__ = module_name
    cls.__qualname__ = cls.__name__
    setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module_name, module)
    return cls


@pytest.fixture
def deepspeed_types(monkeypatch):
    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale = 1.0
            self.dynamic = False

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - DeepSpeed's name
        numel: int
        start: int

    return types.SimpleNamespace(
        LossScaler=_deepspeed_class(monkeypatch, "deepspeed.runtime.fp16.loss_scaler", LossScaler),
        ZeroStageEnum=_deepspeed_class(monkeypatch, "deepspeed.runtime.zero.config", ZeroStageEnum),
        fragment_address=_deepspeed_class(monkeypatch, "deepspeed.utils.tensor_fragment", fragment_address),
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 1)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer("count", torch.tensor(7))
        self.register_buffer("scale", torch.full((2,), 0.5, dtype=torch.bfloat16))


def _groups(model: Model) -> list[OrderedDict[str, torch.Tensor]]:
    named = dict(model.named_parameters())
    return [
        OrderedDict((n, named[n]) for n in ("a.weight", "a.bias")),
        OrderedDict((n, named[n]) for n in ("b.weight", "b.bias")),
    ]


def _moments(model: Model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {name: torch.rand(p.shape, generator=generator) for name, p in model.named_parameters() if p.requires_grad}


def _model_states(model: Model, groups: list[OrderedDict[str, torch.Tensor]], **extra: object) -> dict:
    module = OrderedDict(
        (name, value.detach().to(torch.bfloat16) if value.is_floating_point() else value)
        for name, value in model.state_dict().items()
    )
    return {
        "module": module, "buffer_names": ["count", "scale"], "optimizer": None,
        "param_shapes": [OrderedDict((name, p.shape) for name, p in group.items()) for group in groups],
        "shared_params": {}, "dp_world_size": WORLD, "ds_version": "0.19.8", "global_steps": 3, **extra,
    }  # fmt: skip


def _write_directory(
    directory: Path, model_files: dict[str, dict], optim_files: dict[str, dict], trainer_state: dict | None = None
) -> Path:
    tag = directory / "checkpoint"
    tag.mkdir(parents=True)
    for name, content in {**model_files, **optim_files}.items():
        torch.save(content, tag / name)
    (directory / "latest").write_text("checkpoint")
    state = (
        trainer_state
        if trainer_state is not None
        else {
            "epoch": 1,
            "global_step": 3,
            "loops": {"fit_loop": {"epoch": 1}},
            "optimizer_states": [{"stored_by": "deepspeed"}],
            "lr_schedulers": [{"last_epoch": 3}],
        }
    )
    torch.save(
        {**state, "deepspeed": {"tag": "checkpoint", "zero_stage": 2, "world_size": WORLD}}, directory / STATE_FILE
    )
    return directory


def _zero2_directory(directory: Path, model: Model, types_: types.SimpleNamespace, lean_state: bool = False) -> Path:
    """ZeRO-1/2: each group is one flat vector (aligned to 2 x world size) split evenly; the last rank's master
    partition is saved without its padding, the optimizer state with it."""
    groups, moments = _groups(model), _moments(model)
    optim = {}
    per_rank: list[dict] = [
        {"single_partition_of_fp32_groups": [], "group_paddings": [], "state": [], "mappings": []} for _ in range(WORLD)
    ]
    for group in groups:
        flat = torch.cat([p.detach().reshape(-1) for p in group.values()])
        flat_avg = torch.cat([moments[n].reshape(-1) for n in group])
        aligned = 2 * WORLD * math.ceil(flat.numel() / (2 * WORLD))
        padding = aligned - flat.numel()
        flat, flat_avg = nn.functional.pad(flat, (0, padding)), nn.functional.pad(flat_avg, (0, padding))
        part = aligned // WORLD
        for rank in range(WORLD):
            pad_here = padding if rank == WORLD - 1 else 0
            piece = flat[rank * part : (rank + 1) * part]
            per_rank[rank]["single_partition_of_fp32_groups"].append(piece[: part - pad_here].clone())
            per_rank[rank]["group_paddings"].append(pad_here)
            avg = flat_avg[rank * part : (rank + 1) * part].clone()
            per_rank[rank]["state"].append({"step": torch.tensor(3.0), "exp_avg": avg, "exp_avg_sq": avg * 2})
            per_rank[rank]["mappings"].append(OrderedDict({"a.weight": types_.fragment_address(numel=part, start=0)}))
    for rank, parts in enumerate(per_rank):
        if lean_state:
            base = parts["state"]
        else:
            base = {
                "state": dict(enumerate(parts["state"])),
                "param_groups": [
                    {"lr": 0.1 * (g + 1), "betas": (0.9, 0.999), "params": [g]} for g in range(len(groups))
                ],
            }
        optim[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {
            "optimizer_state_dict": {
                "loss_scaler": types_.LossScaler(),
                "dynamic_loss_scale": False,
                "zero_stage": types_.ZeroStageEnum.gradients,
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": parts["single_partition_of_fp32_groups"],
                "group_paddings": parts["group_paddings"],
                "partition_count": [WORLD] * len(groups),
                "param_alignment_paddings": [[0] * len(group) for group in groups],
                "param_slice_mappings": parts["mappings"],
            },
            "ds_version": "0.19.8",
        }
    return _write_directory(directory, {"mp_rank_00_model_states.pt": _model_states(model, groups)}, optim)


def _zero3_directory(directory: Path, model: Model, types_: types.SimpleNamespace) -> Path:
    """ZeRO-3: each parameter split on its own (ceil(numel / world) per rank), here over two sub-groups of one group."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = [OrderedDict(named)]
    moments = _moments(model)
    sub_groups = [["a.weight", "a.bias"], ["b.weight", "b.bias"]]

    def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
        part = math.ceil(tensor.numel() / WORLD)
        return nn.functional.pad(tensor.detach().reshape(-1), (0, part * WORLD - tensor.numel()))[
            rank * part : (rank + 1) * part
        ]

    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    model_files, optim_files = {}, {}
    for rank in range(WORLD):
        flats = [torch.cat([shard(named[n], rank) for n in names]) for names in sub_groups]
        states = {
            i: {"step": torch.tensor(3.0), "exp_avg": torch.cat([shard(moments[n], rank) for n in names])}
            for i, names in enumerate(sub_groups)
        }
        optim_files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {
            "optimizer_state_dict": {
                "zero_stage": types_.ZeroStageEnum.weights,
                "loss_scaler": types_.LossScaler(),
                "partition_count": WORLD,
                "optimizer_state_dict": {
                    "state": states,
                    "param_groups": [{"lr": 0.1, "params": [i]} for i in range(len(sub_groups))],
                },
                "fp32_flat_groups": flats,
            }
        }
        files = _model_states(
            model,
            groups,
            frozen_param_shapes=OrderedDict((n, p.shape) for n, p in frozen.items()),
            frozen_param_fragments=OrderedDict((n, shard(p, rank).clone()) for n, p in frozen.items()),
        )
        files["module"] = OrderedDict(
            (n, torch.empty(0) if n in named or n in frozen else v) for n, v in files["module"].items()
        )
        model_files[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = files
    return _write_directory(directory, model_files, optim_files)


def _assert_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(reference)
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name


@pytest.mark.parametrize("lean_state", [False, True], ids=["torch-state", "lean-state"])
def test_zero2_directory_becomes_full_weights_and_per_parameter_optimizer_state(tmp_path, deepspeed_types, lean_state):
    model = Model()
    directory = _zero2_directory(tmp_path / "z2.ckpt", model, deepspeed_types, lean_state=lean_state)
    assert is_deepspeed_checkpoint(directory)
    full = load_deepspeed_checkpoint_as_full(directory)
    expected = {
        name: value.float() if value.dtype is torch.bfloat16 else value for name, value in model.state_dict().items()
    }
    # frozen weights come from the module file (bfloat16 there); the trainable ones from the float32 masters
    expected["frozen.weight"] = model.frozen.weight.detach().to(torch.bfloat16).float()
    expected["frozen.bias"] = model.frozen.bias.detach().to(torch.bfloat16).float()
    _assert_equal(full["state_dict"], expected)
    assert full["state_dict"]["count"].dtype is torch.int64 and full["state_dict"]["scale"].dtype is torch.float32
    assert full["global_step"] == 3 and full["lr_schedulers"] == [{"last_epoch": 3}] and "deepspeed" not in full
    if lean_state:  # a lean (per-group list) base state carries no hyper-parameters to rebuild param_groups from
        assert "optimizer_states" not in full
        assert str(directory) in full["optimizer_states_omitted"]  # the reason a resume from it will give
        return
    assert "optimizer_states_omitted" not in full
    optimizer = full["optimizer_states"][0]
    moments = _moments(model)
    assert [group["params"] for group in optimizer["param_groups"]] == [[0, 1], [2, 3]]
    assert [group["lr"] for group in optimizer["param_groups"]] == [0.1, 0.2]
    for index, name in enumerate(["a.weight", "a.bias", "b.weight", "b.bias"]):
        assert torch.equal(optimizer["state"][index]["exp_avg"], moments[name])
        assert torch.equal(optimizer["state"][index]["exp_avg_sq"], moments[name] * 2)
        assert float(optimizer["state"][index]["step"]) == 3.0
    # the result is an ordinary checkpoint: a torch optimizer over the same parameters takes the state
    target = torch.optim.Adam(
        [{"params": [model.a.weight, model.a.bias]}, {"params": [model.b.weight, model.b.bias]}], lr=0.1
    )
    target.load_state_dict(optimizer)
    assert torch.equal(target.state[model.b.weight]["exp_avg"], moments["b.weight"])


def test_zero3_directory_with_sub_groups_and_frozen_parameters(tmp_path, deepspeed_types):
    model = Model()
    full = load_deepspeed_checkpoint_as_full(_zero3_directory(tmp_path / "z3.ckpt", model, deepspeed_types))
    expected = {
        name: value.float() if value.dtype is torch.bfloat16 else value for name, value in model.state_dict().items()
    }
    _assert_equal(full["state_dict"], expected)
    optimizer = full["optimizer_states"][0]
    moments = _moments(model)
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2, 3]}]
    for index, name in enumerate(["a.weight", "a.bias", "b.weight", "b.bias"]):
        assert torch.equal(optimizer["state"][index]["exp_avg"], moments[name])


def test_shared_parameters_and_unmappable_optimizer_state(tmp_path, deepspeed_types):
    model = Model()
    directory = _zero2_directory(tmp_path / "z2.ckpt", model, deepspeed_types)
    model_file = directory / "checkpoint" / "mp_rank_00_model_states.pt"
    states = torch.load(model_file, weights_only=False)
    states["shared_params"] = {"tied.weight": "a.weight"}
    torch.save(states, model_file)
    for rank in range(WORLD):  # a state tensor that is not one value per element cannot be split per parameter
        path = directory / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        optim = torch.load(path, weights_only=False)
        optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"] = torch.zeros(3)
        torch.save(optim, path)
    full = load_deepspeed_checkpoint_as_full(directory)
    assert torch.equal(full["state_dict"]["tied.weight"], full["state_dict"]["a.weight"])
    assert "optimizer_states" not in full  # weights and progress only; documented
    assert "could not be mapped to torch's optimizer layout" in full["optimizer_states_omitted"]


class _RunsCode:
    def __reduce__(self):
        return (print, ("this would run on load",))


@pytest.mark.parametrize("kind", ["other DeepSpeed class", "function call"])
def test_only_deepspeeds_inert_record_types_are_accepted(tmp_path, deepspeed_types, monkeypatch, kind):
    class Settings:
        def __init__(self) -> None:
            self.value = 1

    _deepspeed_class(monkeypatch, "deepspeed.runtime.settings", Settings)
    directory = _zero2_directory(tmp_path / "z2.ckpt", Model(), deepspeed_types)
    path = directory / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim = torch.load(path, weights_only=False)
    optim["optimizer_state_dict"]["extra"] = Settings() if kind == "other DeepSpeed class" else _RunsCode()
    torch.save(optim, path)
    named = "deepspeed.runtime.settings.Settings" if kind == "other DeepSpeed class" else "builtins.print"
    with pytest.raises(
        UnsafeCheckpointError,
        match=rf"Refusing to load .*zero_pp_rank_1_mp_rank_00_optim_states.pt: it references {named}",
    ):
        load_deepspeed_checkpoint_as_full(directory)


def test_directories_that_are_not_deepspeed_checkpoints(tmp_path):
    (tmp_path / "plain").mkdir()
    assert not is_deepspeed_checkpoint(tmp_path / "plain") and not is_deepspeed_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint directory"):
        read_trainer_state(tmp_path / "plain")
    incomplete = _write_directory(tmp_path / "incomplete.ckpt", {}, {})
    with pytest.raises(CheckpointError, match="no DeepSpeed model states file"):
        load_deepspeed_checkpoint_as_full(incomplete)
