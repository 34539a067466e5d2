"""Hostile and damaged checkpoints against every reader of sharded directories and checkpoint files.

Each hostile pickle (tests/checkpoint_attacks.py) would create a marker file if it ran; each is driven through every
way phalanx reads a checkpoint: the DCP helpers, TorchCheckpointIO, Trainer.fit(ckpt_path=DIR / "auto"),
TrainingModule.load_from_checkpoint and ``phalanx checkpoint consolidate``. Every one must refuse with an
UnsafeCheckpointError naming the file and the offending global, and the marker must not exist. Names that lead
outside the directory are refused without a file outside being opened; damaged files give one CheckpointError
naming the file (and the entry, where there is one).
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from checkpoint_attacks import (
    SENTINEL,
    CliError,
    OpenedFiles,
    bare,
    consolidate_through_cli,
    payloads,
    splice,
    text,
    torch_file,
)
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.plugins.io.formats.dcp import load_into, load_whole, read_meta, save_sharded, tensor_entries
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

# Reading and writing without a process group is what these tests do on purpose; DCP says so each time.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol 4"),
]

PAYLOADS = list(payloads(Path("marker")))


# ---------------------------------------------------------------------------- a valid checkpoint to start from
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("base")
    trainer = quiet_trainer(max_steps=2, default_root_dir=root)
    trainer.fit(Regressor(), loaders()[0])
    trainer.save_checkpoint(root / "plain.ckpt")
    checkpoint = torch.load(root / "plain.ckpt", weights_only=True)
    _save(checkpoint, root / "sharded.ckpt")
    checkpoint["global_step"] = 99
    _save(checkpoint, root / "other_save.ckpt")  # same model, another save
    return {"plain": root / "plain.ckpt", "sharded": root / "sharded.ckpt", "other_save": root / "other_save.ckpt"}


def _save(checkpoint: dict[str, Any], path: Path) -> None:
    save_sharded(checkpoint, path, is_global_zero=True, broadcast=lambda value: value, barrier=lambda name: None)


def _copy(source: Path, tmp_path: Path) -> Path:
    """A copy of ``source`` where ckpt_path='auto' finds it: the only checkpoint under tmp_path/run."""
    target = tmp_path / "run" / "checkpoints" / source.name
    target.parent.mkdir(parents=True)
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    return target


def _own_metadata(directory: Path) -> Any:
    return pickle.loads((directory / ".metadata").read_bytes())  # written by this test: trusted


# ---------------------------------------------------------------------------- every reader


def _refusal(reader: str) -> type[CheckpointError]:
    return CliError if reader == "cli consolidate" else UnsafeCheckpointError  # the CLI prints the message only


def _fit(path: Path, tmp_path: Path) -> None:
    quiet_trainer(max_steps=3, default_root_dir=tmp_path / "run").fit(Regressor(), loaders()[0], ckpt_path=str(path))


def _fit_auto(path: Path, tmp_path: Path) -> None:
    trainer = quiet_trainer(max_steps=3, default_root_dir=tmp_path / "run")
    assert trainer._checkpoint_connector.find_newest_complete() == str(path.resolve())
    trainer.fit(Regressor(), loaders()[0], ckpt_path="auto")


READERS: dict[str, Callable[[Path, Path], Any]] = {
    "read_meta": lambda path, tmp: read_meta(path),
    "tensor_entries": lambda path, tmp: tensor_entries(path),
    "load_whole": lambda path, tmp: load_whole(path),
    "load_into": lambda path, tmp: load_into(path, Regressor().state_dict(), []),
    "TorchCheckpointIO": lambda path, tmp: TorchCheckpointIO().load_checkpoint(path),
    "Trainer.fit(ckpt_path=path)": _fit,
    "Trainer.fit(ckpt_path='auto')": _fit_auto,
    "load_from_checkpoint": lambda path, tmp: Regressor.load_from_checkpoint(path),
    "cli consolidate": consolidate_through_cli,
}
METADATA_READERS = [name for name in READERS if name != "read_meta"]  # read_meta reads phalanx_meta.pt only
META_FILE_READERS = [name for name in READERS if name != "tensor_entries"]  # tensor_entries reads .metadata only
FILE_READERS = [
    "TorchCheckpointIO",
    "Trainer.fit(ckpt_path=path)",
    "Trainer.fit(ckpt_path='auto')",
    "load_from_checkpoint",
]


def test_every_reader_reads_the_untouched_checkpoints(base, tmp_path):
    directory = _copy(base["sharded"], tmp_path)
    for name, reader in READERS.items():
        if name != "Trainer.fit(ckpt_path='auto')":
            reader(directory, tmp_path)
    assert torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["global_step"] == 2
    _fit_auto(directory, tmp_path)
    file = _copy(base["plain"], tmp_path / "file")
    for name in FILE_READERS:
        READERS[name](file, tmp_path / "file")


@pytest.mark.parametrize("legacy", [False, True], ids=["protocol 4", "torch.save's protocol 2 opcodes"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_every_payload_runs_code_when_unpickled_naively(tmp_path, payload, legacy):
    """The table is live: plain pickle.loads of the spliced pickle creates the marker (so the refusals matter)."""
    marker = tmp_path / "marker"
    ops, _ = payloads(marker, legacy=legacy)[payload]
    with contextlib.suppress(Exception):
        pickle.loads(splice({"planner_data": SENTINEL}, ops, legacy=legacy))
    for _ in range(100):  # subprocess.Popen runs in the background
        if marker.exists():
            break
        time.sleep(0.02)
    assert marker.exists()


# ---------------------------------------------------------------------------- item 1: hostile pickles
def _assert_refused(error: BaseException, file: str, offending: str, marker: Path) -> None:
    message = str(error)
    assert file in message and offending in message, message
    assert not marker.exists()


@pytest.mark.parametrize("reader", METADATA_READERS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_dcp_metadata_is_refused_by_every_reader(base, tmp_path, payload, reader):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker)[payload]
    directory = _copy(base["sharded"], tmp_path)
    metadata = _own_metadata(directory)
    metadata.planner_data = SENTINEL  # the payload sits inside otherwise valid metadata
    (directory / ".metadata").write_bytes(splice(metadata, ops))
    with pytest.raises(_refusal(reader)) as refused:
        READERS[reader](directory, tmp_path)
    _assert_refused(refused.value, str(directory / ".metadata"), offending, marker)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_bare_hostile_metadata_file_is_refused(base, tmp_path, payload):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker)[payload]
    directory = _copy(base["sharded"], tmp_path)
    (directory / ".metadata").write_bytes(bare(ops))
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_whole(directory)
    _assert_refused(refused.value, ".metadata", offending, marker)


def test_the_spliced_metadata_is_valid_without_a_payload(base, tmp_path):
    directory = _copy(base["sharded"], tmp_path)
    metadata = _own_metadata(directory)
    metadata.planner_data = SENTINEL
    (directory / ".metadata").write_bytes(splice(metadata, text("harmless")))
    assert load_whole(directory)["global_step"] == 2


def _hostile_torch_file(ops: bytes, extra: dict[str, Any]) -> bytes:
    return torch_file(splice({**extra, "hostile": SENTINEL}, ops, legacy=True))


@pytest.mark.parametrize("reader", META_FILE_READERS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_phalanx_meta_file_is_refused_by_every_reader(base, tmp_path, payload, reader):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker, legacy=True)[payload]
    directory = _copy(base["sharded"], tmp_path)
    plain = {"epoch": 0, "global_step": 2, "sharded_tensors": read_meta(directory)["sharded_tensors"]}
    (directory / "phalanx_meta.pt").write_bytes(_hostile_torch_file(ops, plain))
    with pytest.raises(_refusal(reader)) as refused:
        READERS[reader](directory, tmp_path)
    _assert_refused(refused.value, str(directory / "phalanx_meta.pt"), offending, marker)


@pytest.mark.parametrize("reader", FILE_READERS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_checkpoint_file_is_refused_by_every_reader(base, tmp_path, payload, reader):
    marker = tmp_path / "marker"
    ops, offending = payloads(marker, legacy=True)[payload]
    file = _copy(base["plain"], tmp_path)
    file.write_bytes(_hostile_torch_file(ops, {"epoch": 0, "global_step": 2, "state_dict": {}}))
    with pytest.raises(UnsafeCheckpointError) as refused:
        READERS[reader](file, tmp_path)
    _assert_refused(refused.value, str(file), offending, marker)


def test_byte_entries_are_never_unpickled(base, tmp_path):
    """DCP unpickles byte entries with weights_only=False: a metadata that turns a listed tensor into one is refused."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = _copy(base["sharded"], tmp_path)
    metadata = _own_metadata(directory)
    metadata.state_dict_metadata["model/net.0.weight"] = BytesStorageMetadata()
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    for reader in ("load_whole", "load_into"):
        with pytest.raises(
            CheckpointError, match="'model/net.0.weight', listed in phalanx_meta.pt, is not a tensor entry in .metadata"
        ):
            READERS[reader](directory, tmp_path)


def test_a_read_that_asks_for_byte_entries_is_refused_by_the_reader_itself(base, tmp_path):
    """The second guard: even asked to, phalanx's DCP reader never hands DCP's byte entries to DCP's unpickler."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from phalanx.plugins.io.formats.dcp import _safe_reader_class
    from phalanx.plugins.io.formats.dcp_metadata import read_metadata

    directory = _copy(base["sharded"], tmp_path)
    reader = _safe_reader_class()(directory, read_metadata(directory))
    index = MetadataIndex("model/net.0.weight", torch.Size([0, 0]))
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=index,
        dest_offsets=torch.Size([0]),
        storage_index=index,
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(UnsafeCheckpointError, match="'model/net.0.weight' is stored as pickled bytes"):
        reader.read_data(LoadPlan([item]), planner=None)


# ---------------------------------------------------------------------------- item 6: names leading outside
@pytest.fixture
def outside(base, tmp_path) -> Path:
    """A valid checkpoint of the same model (step 99) outside the one read: a hostile name would pick its shard."""
    target = tmp_path / "outside"
    shutil.copytree(base["other_save"], target)
    return target


def _fingerprint(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _assert_outside_untouched(opened: list[str], outside: Path, before: dict[str, str]) -> None:
    assert not [path for path in opened if path.startswith(str(outside.resolve()))]
    assert _fingerprint(outside) == before


HOSTILE_SHARD_NAMES: dict[str, Callable[[Path, Path], Any]] = {
    "parent": lambda directory, outside: "../../../outside/__0_0.distcp",
    "absolute": lambda directory, outside: str(outside / "__0_0.distcp"),
    "separator": lambda directory, outside: "sub/__0_0.distcp",
    "dot-dot": lambda directory, outside: "..",
    "dot": lambda directory, outside: ".",
    "empty": lambda directory, outside: "",
    "backslash": lambda directory, outside: "..\\__0_0.distcp",
    "nul": lambda directory, outside: "__0_0.distcp\0.txt",
    "not a string": lambda directory, outside: Path("__0_0.distcp"),
    "symlink to outside": lambda directory, outside: (
        (directory / "link.distcp").symlink_to(outside / "__0_0.distcp") or "link.distcp"
    ),
}


@pytest.mark.parametrize("reader", METADATA_READERS)
@pytest.mark.parametrize("name", list(HOSTILE_SHARD_NAMES))
def test_shard_names_leading_outside_are_refused(base, tmp_path, outside, name, reader):
    directory = _copy(base["sharded"], tmp_path)
    metadata = _own_metadata(directory)
    hostile = HOSTILE_SHARD_NAMES[name](directory, outside)
    for info in metadata.storage_data.values():
        info.relative_path = hostile
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    before = _fingerprint(outside)
    with OpenedFiles() as opened, pytest.raises(_refusal(reader)) as refused:
        READERS[reader](directory, tmp_path)
    message = str(refused.value)
    assert "the shard file of entry 'model/" in message
    assert repr(hostile) in message or "outside the checkpoint directory" in message
    _assert_outside_untouched(opened, outside, before)


@pytest.mark.parametrize("file", [".metadata", "phalanx_meta.pt", "__0_0.distcp"])
@pytest.mark.parametrize(
    "reader",
    [
        "load_whole",
        "load_into",
        "TorchCheckpointIO",
        "Trainer.fit(ckpt_path=path)",
        "load_from_checkpoint",
        "cli consolidate",
    ],
)
def test_files_that_are_links_to_outside_are_refused(base, tmp_path, outside, file, reader):
    directory = _copy(base["sharded"], tmp_path)
    (directory / file).unlink()
    (directory / file).symlink_to(outside / file)
    before = _fingerprint(outside)
    with (
        OpenedFiles() as opened,
        pytest.raises(_refusal(reader), match=rf"leads to {outside / file}, outside the checkpoint directory"),
    ):
        READERS[reader](directory, tmp_path)
    _assert_outside_untouched(opened, outside, before)


def test_links_that_stay_inside_the_checkpoint_are_fine(base, tmp_path):
    directory = _copy(base["sharded"], tmp_path)
    (directory / "__0_0.distcp").rename(directory / "data.bin")
    (directory / "__0_0.distcp").symlink_to("data.bin")
    with OpenedFiles() as opened:
        assert load_whole(directory)["global_step"] == 2
    assert str((directory / "data.bin").resolve()) in opened  # the watch sees DCP's reads (so its silence above counts)
