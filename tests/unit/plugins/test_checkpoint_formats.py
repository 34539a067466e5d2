"""The list of on-disk layouts (``phalanx.plugins.io.formats.FORMATS``) is the only place a layout is named.

A layout appended to the list is detected by ``checkpoint_layout``, loaded whole by ``TorchCheckpointIO`` and turned
into one file by ``phalanx checkpoint consolidate``, with nothing else changed; without the entry, all three refuse
the same directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.cli import main
from phalanx.plugins.io import formats
from phalanx.plugins.io.formats import FORMATS, Format, not_a_checkpoint
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.trainer.checkpoint import COMPLETE_MARKER
from phalanx.utilities.exceptions import CheckpointError

FAKE_FILES = ("fake_state.pt", "fake_index")


def _load_fake(directory: Path) -> dict[str, Any]:
    return {"state_dict": {"weight": torch.load(directory / FAKE_FILES[0])}, "global_step": 7}


FAKE = Format("fake", "a fake", FAKE_FILES, lambda d: all((d / n).exists() for n in FAKE_FILES), _load_fake)


def _fake_directory(path: Path, files: tuple[str, ...] = FAKE_FILES, complete: bool = True) -> Path:
    path.mkdir()
    for name in files:
        if name == FAKE_FILES[0]:
            torch.save(torch.arange(6.0), path / name)
        else:
            (path / name).write_text("index")
    if complete:
        (path / COMPLETE_MARKER).write_text("")
    return path


@pytest.fixture
def with_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "FORMATS", [*FORMATS, FAKE])


def _consolidate(directory: Path, output: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["checkpoint", "consolidate", str(directory), str(output)])
    return code, capsys.readouterr().err


def test_an_appended_layout_is_detected_loaded_and_consolidated(with_fake, tmp_path, capsys):
    directory = _fake_directory(tmp_path / "fake.ckpt")
    assert checkpoint_layout(directory) == "fake"
    whole = TorchCheckpointIO().load_checkpoint(directory)
    assert whole["global_step"] == 7 and torch.equal(whole["state_dict"]["weight"], torch.arange(6.0))
    code, err = _consolidate(directory, tmp_path / "out.ckpt", capsys)
    assert code == 0, err
    written = TorchCheckpointIO().load_checkpoint(tmp_path / "out.ckpt")
    assert written["global_step"] == 7 and torch.equal(written["state_dict"]["weight"], torch.arange(6.0))


def test_without_the_entry_every_reader_refuses_the_same_directory(tmp_path, capsys):
    directory = _fake_directory(tmp_path / "fake.ckpt")
    for read in (checkpoint_layout, TorchCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointError, match="is a directory but not a complete checkpoint"):
            read(directory)
    code, err = _consolidate(directory, tmp_path / "out.ckpt", capsys)
    assert code == 2 and "not a checkpoint phalanx can read" in err
    assert not (tmp_path / "out.ckpt").exists()


def test_an_appended_layout_follows_the_completion_marker_rule(with_fake, tmp_path):
    directory = _fake_directory(tmp_path / "fake.ckpt", complete=False)
    for read in (checkpoint_layout, TorchCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointError, match=f"incomplete fake checkpoint: it has no {COMPLETE_MARKER} marker"):
            read(directory)


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        (FAKE_FILES[:1], "looks like a fake checkpoint (fake_state.pt) but is missing fake_index"),
        (FAKE_FILES[1:], "looks like a fake checkpoint (fake_index) but is missing fake_state.pt"),
    ],
)
def test_an_appended_layout_missing_a_file_is_refused_naming_it(with_fake, tmp_path, capsys, files, fragment):
    directory = _fake_directory(tmp_path / "fake.ckpt", files)
    with pytest.raises(CheckpointError, match="not a complete checkpoint") as layout_error:
        checkpoint_layout(directory)
    assert "a fake one holds fake_state.pt, fake_index" in str(layout_error.value)
    code, err = _consolidate(directory, tmp_path / "out.ckpt", capsys)
    assert code == 2 and fragment in err
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("entry", [entry for entry in FORMATS if entry.is_directory], ids=lambda entry: entry.name)
def test_every_directory_layout_is_named_where_a_directory_is_refused(tmp_path, entry):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(CheckpointError) as layout_error:
        checkpoint_layout(plain)
    assert f"{entry.title} one holds {', '.join(entry.files)}" in str(layout_error.value)
    assert entry.title in str(not_a_checkpoint(plain))


def test_the_list_holds_the_four_layouts_once():
    names = [entry.name for entry in FORMATS]
    assert names == ["file", "sharded", "deepspeed", "xla_fsdp"]
    assert len({name for entry in FORMATS for name in entry.files}) == sum(len(entry.files) for entry in FORMATS)
