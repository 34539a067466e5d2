"""Sharded checkpoint directories, read and written in one process (DCP without a process group)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from phalanx.plugins.io.formats import consolidate
from phalanx.plugins.io.formats.dcp import (
    is_sharded_checkpoint,
    load_whole,
    read_meta,
    save_sharded,
    split_checkpoint,
)
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.trainer.checkpoint import COMPLETE_MARKER, is_complete_checkpoint, newest_complete_checkpoint
from phalanx.utilities.dtensor import full_optimizer_state, load_module_state, load_optimizer_state
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError, UnsafeCheckpointError

# Saving without a process group is what these tests do on purpose; DCP says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _checkpoint(step: int = 3) -> dict:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return {
        "global_step": step,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "loops": {"fit_loop": {"epoch": 0}},
    }


def _save(checkpoint: dict, path) -> None:
    save_sharded(checkpoint, path, is_global_zero=True, broadcast=lambda value: value, barrier=lambda name: None)


def test_round_trip_of_plain_tensors(tmp_path):
    checkpoint = _checkpoint()
    path = tmp_path / "step=3.ckpt"
    _save(checkpoint, path)
    assert is_sharded_checkpoint(path) and is_complete_checkpoint(path)
    assert "state_dict" not in read_meta(path)
    loaded = load_whole(path)
    assert loaded["global_step"] == 3 and "sharded_tensors" not in loaded
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], value)
    assert torch.equal(
        loaded["optimizer_states"][0]["state"][0]["exp_avg"], checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    )
    # TorchCheckpointIO reads a directory whole, so any strategy can resume from it
    assert torch.equal(
        TorchCheckpointIO().load_checkpoint(path)["state_dict"]["1.bias"], checkpoint["state_dict"]["1.bias"]
    )


def test_only_tensors_go_to_dcp_and_everything_else_stays_plain():
    tensors, meta = split_checkpoint(_checkpoint())
    assert all(isinstance(value, torch.Tensor) for value in tensors.values())
    assert set(tensors) == {f"model/{name}" for name in ("0.weight", "0.bias", "1.weight", "1.bias")}
    assert meta["sharded_tensors"]["model"] == sorted(["0.weight", "0.bias", "1.weight", "1.bias"])
    assert meta["optimizer_states"][0]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_a_second_save_replaces_the_first_and_a_failed_save_leaves_it(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    _save(_checkpoint(1), path)
    _save(_checkpoint(2), path)
    assert load_whole(path)["global_step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary or retired directory left

    import torch.distributed.checkpoint as dcp

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", broken_save)
    with pytest.raises(
        CheckpointWriteError, match=r"Could not write the sharded checkpoint .*last.ckpt: OSError: disk full"
    ):
        _save(_checkpoint(3), path)
    assert load_whole(path)["global_step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_an_unfinished_directory_is_never_chosen_to_resume(tmp_path):
    _save(_checkpoint(1), tmp_path / "a.ckpt")
    _save(_checkpoint(2), tmp_path / "b.ckpt")
    (tmp_path / "b.ckpt" / COMPLETE_MARKER).unlink()  # as if a rank died before the end
    assert newest_complete_checkpoint([tmp_path]) == str((tmp_path / "a.ckpt").resolve())


def test_metadata_that_references_other_classes_is_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    _save(_checkpoint(), path)
    (path / ".metadata").write_bytes(pickle.dumps({"payload": print}))
    with pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        load_whole(path)


def test_a_directory_that_is_no_checkpoint_gets_a_clear_error(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(CheckpointError, match="not a sharded .DCP. checkpoint, a DeepSpeed one or an xla_fsdp one"):
        consolidate(tmp_path / "notes")
    with pytest.raises(CheckpointError, match="not a sharded phalanx checkpoint"):
        read_meta(tmp_path / "notes")


def test_plain_module_and_optimizer_states_load_through_the_sharding_helpers():
    source = _checkpoint()
    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters())
    load_module_state(model, source["state_dict"])
    load_optimizer_state(optimizer, source["optimizer_states"][0])
    assert torch.equal(model[0].weight, source["state_dict"]["0.weight"])
    whole = full_optimizer_state(optimizer, keep=True)
    assert torch.equal(whole["state"][3]["exp_avg_sq"], source["optimizer_states"][0]["state"][3]["exp_avg_sq"])
    assert full_optimizer_state(optimizer, keep=False) == {}
    with pytest.raises(ValueError, match="covers 4 parameters but the optimizer has 2"):
        load_optimizer_state(torch.optim.Adam(model[0].parameters()), source["optimizer_states"][0])


def test_cli_consolidate_reports_bad_input(tmp_path, capsys):
    from phalanx.cli import main

    assert main(["checkpoint", "consolidate", str(tmp_path / "missing"), str(tmp_path / "out.ckpt")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["checkpoint", "consolidate", str(tmp_path / "empty"), str(tmp_path / "out.ckpt")]) == 2
    assert "not a checkpoint phalanx can read" in capsys.readouterr().err
    _save(_checkpoint(5), tmp_path / "good.ckpt")
    assert main(["checkpoint", "consolidate", str(tmp_path / "good.ckpt"), str(tmp_path / "out.ckpt")]) == 0
    assert torch.load(tmp_path / "out.ckpt", weights_only=True)["global_step"] == 5
