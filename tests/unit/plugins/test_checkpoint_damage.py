"""Damaged sharded checkpoints, and sharded saves that fail: one clear CheckpointError naming the file, never DCP's
CheckpointException (a BaseException naming no file), and a failed save never costs the previous checkpoint."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_attacks import DAMAGE_KINDS, damage
from torch import nn

from phalanx.plugins.io.formats.dcp import load_whole, save_sharded
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _checkpoint(step: int, width: int = 4) -> dict[str, Any]:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(3, width), nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}


def _save(checkpoint: dict[str, Any], path: Path) -> Path:
    save_sharded(checkpoint, path, is_global_zero=True, broadcast=lambda value: value, barrier=lambda name: None)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "good": _save(_checkpoint(3), root / "good.ckpt"),
        "same model, another save": _save(_checkpoint(4), root / "other_save.ckpt"),
        "another model": _save(_checkpoint(5, width=6), root / "other_model.ckpt"),
    }


def _cli(path: Path) -> None:
    from phalanx.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["checkpoint", "consolidate", str(path), str(path.parent / "out.ckpt")])
    assert status == 2 and not (path.parent / "out.ckpt").exists()
    raise CheckpointError(err.getvalue())


READERS = {
    "load_whole": load_whole,
    "TorchCheckpointIO": lambda path: TorchCheckpointIO().load_checkpoint(path),
    "cli consolidate": _cli,
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("kind", DAMAGE_KINDS)
@pytest.mark.parametrize("file", ["__0_0.distcp", ".metadata", "phalanx_meta.pt"])
def test_a_damaged_file_gives_one_checkpoint_error_naming_it(sources, tmp_path, file, kind, reader):
    directory = tmp_path / "damaged.ckpt"
    shutil.copytree(sources["good"], directory)
    damage(directory / file, kind)
    with pytest.raises(CheckpointError) as failed:
        READERS[reader](directory)
    message = str(failed.value)
    assert str(directory) in message and file in message, message
    if file == "__0_0.distcp":
        assert "entry 'model/" in message or "entry 'optimizer/" in message, message  # where the bytes went missing


@pytest.mark.parametrize(
    ("source", "file", "expected"),
    [
        ("same model, another save", ".metadata", r"\.metadata belongs to another checkpoint: it was written by save"),
        (
            "same model, another save",
            "phalanx_meta.pt",
            r"\.metadata belongs to another checkpoint: it was written by save",
        ),
        (
            "another model",
            ".metadata",
            r"__0_0.distcp is truncated or belongs to another checkpoint: entry 'model/1.bias'",
        ),
        (
            "another model",
            "__0_0.distcp",
            r"__0_0.distcp is (truncated|damaged) or belongs to another checkpoint: entry 'model/",
        ),
        ("another model", "phalanx_meta.pt", r"\.metadata belongs to another checkpoint"),
    ],
)
def test_files_of_another_checkpoint_are_recognised(sources, tmp_path, source, file, expected):
    directory = tmp_path / "mixed.ckpt"
    shutil.copytree(sources["good"], directory)
    shutil.copyfile(sources[source] / file, directory / file)
    with pytest.raises(CheckpointError, match=expected):
        load_whole(directory)


def test_metadata_claiming_a_huge_tensor_is_refused_before_allocating(sources, tmp_path):
    directory = tmp_path / "huge.ckpt"
    shutil.copytree(sources["good"], directory)
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # written by this test: trusted
    entry = metadata.state_dict_metadata["model/0.weight"]
    entry.size = torch.Size([2**40, 2**20])
    entry.chunks[0].sizes = torch.Size([2**40, 2**20])
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        CheckpointError,
        match=r"entry 'model/0.weight' claims 1152921504606846976 elements of torch.float32 in \d+ bytes of"
        r" __0_0.distcp",
    ):
        load_whole(directory)


# ---------------------------------------------------------------------------- failed saves
def _no_space(path: Any = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path is not None else None)


def _fail_dcp_write(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    import torch.distributed.checkpoint.filesystem as filesystem

    original = filesystem._write_item

    def write_then_fail(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)  # some bytes reach the disk, then it is full
        raise error

    monkeypatch.setattr(filesystem, "_write_item", write_then_fail)


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("shard", r"No space left on device \[ENOSPC\] \(.*__0_0.distcp\)"),
        (
            "zip writer",
            r"RuntimeError: \[enforce fail at inline_container.cc:664\] . unexpected pos 704 vs 598;"
            r" \d+ bytes are free",
        ),
        ("meta file", r"No space left on device \[ENOSPC\] \(.*phalanx_meta.pt\)"),
    ],
)
def test_a_save_that_runs_out_of_space_names_the_directory_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, where, expected
):
    target = _save(_checkpoint(1), tmp_path / "last.ckpt")
    if where == "shard":
        _fail_dcp_write(monkeypatch, _no_space(tmp_path / ".last.ckpt.tmp" / "__0_0.distcp"))
    elif where == "zip writer":
        _fail_dcp_write(
            monkeypatch, RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
        )
    else:
        import phalanx.plugins.io.formats.dcp as module

        def full(meta: dict, path: Path) -> None:  # the meta file's streamed write fills the disk part-way
            Path(path).write_bytes(b"PK\x03\x04 part")
            raise _no_space(path)

        monkeypatch.setattr(module, "save_into", full)
    with pytest.raises(
        CheckpointWriteError, match=rf"Could not write the sharded checkpoint {target}: {expected}"
    ) as failed:
        _save(_checkpoint(2), target)
    assert isinstance(failed.value, Exception) and "the previous checkpoint at" in str(failed.value)
    monkeypatch.undo()
    assert load_whole(target)["global_step"] == 1  # the previous checkpoint, whole
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # nothing half-written left beside it


def test_an_interrupt_during_a_save_is_not_turned_into_a_checkpoint_error(tmp_path, monkeypatch):
    target = _save(_checkpoint(1), tmp_path / "last.ckpt")
    _fail_dcp_write(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _save(_checkpoint(2), target)
    monkeypatch.undo()
    assert load_whole(target)["global_step"] == 1
