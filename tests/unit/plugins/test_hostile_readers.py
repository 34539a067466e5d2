"""Hostile single files and checkpoint folders against every reader, each run in a child with an address-space limit
and an alarm (tests/bounded_child.py): files of a few KB that claim gigabytes, files that are not regular files,
non-checkpoints that a refusal would read whole, and links planted where ckpt_path="auto"/"last" look.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import struct
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from bounded_child import Outcome, run_bounded
from checkpoint_attacks import payloads, torch_file
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.trainer.checkpoint import newest_complete_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected pickle protocol 4"),
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's"),
]

CLAIM = 1 << 29  # elements (bytes, as uint8) each hostile file claims: more than the child's address-space headroom


def _saved(value: Any, **options: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer, **options)
    return buffer.getvalue()


def _claiming(data: bytes, claim: int, *, first: int = 0) -> bytes:
    """``data`` (the pickle of a 255-element uint8 tensor) with its element count and size changed to ``claim``
    (from the ``first``-th mention of 255 on: 0 is the storage's size, 1 the tensor's)."""
    head, *mentions = data.split(b"K\xff")
    changed = b"J" + struct.pack("<i", claim)
    return head + b"".join((changed if index >= first else b"K\xff") + rest for index, rest in enumerate(mentions))


def _quantized(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors: that is not what is tested
        tensor = torch.quantize_per_tensor(torch.zeros(255), 0.1, 0, torch.quint8)
    source = zipfile.ZipFile(io.BytesIO(_saved({"state_dict": {"w": tensor}})))
    with zipfile.ZipFile(path, "w") as archive:
        for info in source.infolist():
            content = source.read(info.filename)
            archive.writestr(
                info.filename, _claiming(content, CLAIM, first=1) if info.filename.endswith(".pkl") else content
            )


def _compressed_storage(path: Path) -> None:
    """A torch.save archive whose one storage claims CLAIM zero bytes, stored deflated (a few hundred KB)."""
    source = zipfile.ZipFile(io.BytesIO(_saved({"state_dict": {"w": torch.zeros(255, dtype=torch.uint8)}})))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for info in source.infolist():
            if info.filename.endswith("data/0"):
                with archive.open(info.filename, "w", force_zip64=True) as entry:
                    zeros = bytes(1 << 20)
                    for _ in range(CLAIM >> 20):
                        entry.write(zeros)
            else:
                content = source.read(info.filename)
                archive.writestr(
                    info.filename, _claiming(content, CLAIM) if info.filename.endswith(".pkl") else content
                )
    assert path.stat().st_size < 4 << 20


def _oversized_entry(path: Path) -> None:
    """A torch.save archive whose directory says its storage entry holds 2**31 - 1 bytes (the file holds a few KB)."""
    data = bytearray(_saved({"state_dict": {"w": torch.zeros(255, dtype=torch.uint8)}}))
    start = 0
    while (start := data.find(b"PK\x01\x02", start + 1)) != -1:  # each entry of the central directory
        length = struct.unpack_from("<H", data, start + 28)[0]
        if bytes(data[start + 46 : start + 46 + length]).endswith(b"data/0"):
            struct.pack_into("<II", data, start + 20, (1 << 31) - 1, (1 << 31) - 1)  # compressed, uncompressed size
    path.write_bytes(bytes(data))


def _write(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))  # left bound: the file stays a socket for the test's life
    _SOCKETS.append(server)


_SOCKETS: list[socket.socket] = []


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")


# name -> (make the file at the path, what the refusal must say)
HOSTILE_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a one-element storage expanded to 2**29 elements": (
        _write(_saved({"state_dict": {"w": torch.zeros(1).expand(CLAIM)}})),
        r"claims 536870912 elements of torch.float32 .* storage in the file holds 4 bytes",
    ),
    "overlapping strides (2**14 x 2**14 over 2**15 elements)": (
        _write(_saved({"state_dict": {"w": torch.zeros(1 << 15).as_strided((1 << 14, 1 << 14), (1, 1))}})),
        r"claims 268435456 elements .* zero or overlapping strides",
    ),
    "a storage stored deflated (a zip bomb)": (_compressed_storage, r"compressed"),
    "an entry claiming more bytes than the file": (_oversized_entry, r"entries claim \d+ bytes but the file holds"),
    "torch's legacy format claiming 2**29 bytes": (
        _write(
            _claiming(_saved({"w": torch.zeros(255, dtype=torch.uint8)}, _use_new_zipfile_serialization=False), CLAIM)
        ),
        r"legacy format",
    ),
    "a quantized tensor claiming 2**29 elements of 255 stored": (_quantized, r"holds a quantized tensor"),
    "a named pipe (FIFO)": (_fifo, r"is a named pipe \(FIFO\), not a regular file"),
    "a link to /dev/zero": (_device, r"is a character device, not a regular file"),
    "a socket": (_socket, r"is a socket, not a regular file"),
}


def _fit(path: Path, tmp: Path) -> None:
    quiet_trainer(max_steps=1, default_root_dir=tmp / "fresh").fit(Regressor(), loaders()[0], ckpt_path=str(path))


FILE_READERS: dict[str, Callable[[Path, Path], Any]] = {
    "TorchCheckpointIO": lambda path, tmp: TorchCheckpointIO().load_checkpoint(path),
    "load_from_checkpoint": lambda path, tmp: Regressor.load_from_checkpoint(path),
    "Trainer.fit(ckpt_path=path)": _fit,
}


def _assert_refused(outcome: Outcome, message: str) -> None:
    assert outcome.error in ("CheckpointError", "UnsafeCheckpointError"), str(outcome)
    assert re.search(message, outcome.message), str(outcome)


@pytest.mark.parametrize("reader", list(FILE_READERS))
@pytest.mark.parametrize("attack", list(HOSTILE_FILES))
def test_a_hostile_file_is_refused_by_every_reader_within_bounded_memory_and_time(tmp_path, attack, reader):
    make, message = HOSTILE_FILES[attack]
    path = tmp_path / "hostile.ckpt"
    make(path)
    outcome = run_bounded(lambda: FILE_READERS[reader](path, tmp_path))
    _assert_refused(outcome, message)
    assert str(path) in outcome.message


# ---------------------------------------------------------------------------- refusing reads a bounded amount
SPARSE = 256 << 20


def _sparse_zeros(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(SPARSE)


def _hostile_pickle_then_zeros(path: Path) -> None:
    ops, _ = payloads(path.with_name("marker"))["dotted os.system through torch"]
    with open(path, "wb") as handle:
        handle.write(b"\x80\x04" + ops + b".")
        handle.truncate(SPARSE)


def _hostile_archive_with_a_large_entry(path: Path) -> None:
    ops, _ = payloads(path.with_name("marker"))["dotted os.system through torch"]
    path.write_bytes(torch_file(b"\x80\x04" + ops + b"."))
    with zipfile.ZipFile(path, "a") as archive, archive.open("archive/data/0", "w", force_zip64=True) as entry:
        zeros = bytes(1 << 20)  # an entry torch.load never asks for
        for _ in range(SPARSE >> 20):
            entry.write(zeros)


NOT_CHECKPOINTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "256 MiB of zeros (sparse)": (_sparse_zeros, r"is not a checkpoint torch can read"),
    "a hostile pickle followed by 256 MiB of zeros": (_hostile_pickle_then_zeros, r"references torch\.os\.system"),
    "a hostile torch archive with a 256 MiB entry": (
        _hostile_archive_with_a_large_entry,
        r"references torch\.os\.system",
    ),
}


@pytest.mark.parametrize("reader", ["TorchCheckpointIO", "load_from_checkpoint"])
@pytest.mark.parametrize("attack", list(NOT_CHECKPOINTS))
def test_refusing_a_large_non_checkpoint_reads_only_what_deciding_needs(tmp_path, attack, reader):
    make, message = NOT_CHECKPOINTS[attack]
    path = tmp_path / "large.ckpt"
    make(path)
    outcome = run_bounded(lambda: FILE_READERS[reader](path, tmp_path), headroom=1 << 30)
    _assert_refused(outcome, message)
    assert 0 <= outcome.read_bytes < 16 << 20, f"read {outcome.read_bytes} bytes of a {SPARSE}-byte file to refuse it"
    assert not path.with_name("marker").exists()


# ---------------------------------------------------------------------------- what ckpt_path="auto" and "last" choose
@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("honest")
    trainer = quiet_trainer(max_steps=1, default_root_dir=root)
    trainer.fit(Regressor(), loaders()[0])
    trainer.save_checkpoint(root / "honest.ckpt")
    return root / "honest.ckpt"


def _planted_link(target: Callable[[Path], Path]) -> Callable[[Path, Path, Path], None]:
    def plant(folder: Path, name: Path, outside: Path) -> None:
        name.symlink_to(target(outside))

    return plant


# name -> plant something newer than the honest checkpoint at folder/NAME (outside: a folder with a checkpoint)
PLANTED: dict[str, Callable[[Path, Path, Path], None]] = {
    "a link to a checkpoint file outside": _planted_link(lambda outside: outside / "other.ckpt"),
    "a link to a folder holding a checkpoint outside": _planted_link(lambda outside: outside),
    "a link to /dev/zero": _planted_link(lambda outside: Path("/dev/zero")),
    "a named pipe (FIFO)": lambda folder, name, outside: os.mkfifo(name),
    "a socket": lambda folder, name, outside: _socket(name),
}


def _plant(honest: Path, tmp_path: Path, attack: str, name: str) -> tuple[Path, Path]:
    folder, outside = tmp_path / "run" / "checkpoints", tmp_path / "elsewhere"
    folder.mkdir(parents=True)
    outside.mkdir()
    shutil.copyfile(honest, outside / "other.ckpt")
    (outside / ".complete").write_bytes(b"")  # a linked folder would pass for a finished directory checkpoint
    kept = folder / name.replace("NAME", "kept")
    shutil.copyfile(honest, kept)
    old = time.time() - 3600
    os.utime(kept, (old, old))  # the planted entry is newer: it would win on modification time
    PLANTED[attack](folder, folder / name.replace("NAME", "planted"), outside)
    return folder, kept


def _resolve(tmp_path: Path, which: str) -> str | None:
    trainer = quiet_trainer(
        max_steps=1,
        default_root_dir=tmp_path / "run",
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "run" / "checkpoints", save_last=True)],
    )
    return trainer._checkpoint_connector.resolve_path(which)


@pytest.mark.parametrize(("which", "name"), [("auto", "NAME.ckpt"), ("last", "last-NAME.ckpt")])
@pytest.mark.parametrize("attack", list(PLANTED))
def test_auto_and_last_never_choose_an_entry_planted_to_lead_outside_or_block(honest, tmp_path, attack, which, name):
    folder, kept = _plant(honest, tmp_path, attack, name)

    def choose() -> None:
        raise Chosen(str(_resolve(tmp_path, which)))

    outcome = run_bounded(choose)
    assert outcome.error == "Chosen", str(outcome)
    assert outcome.message == str(kept.resolve()), f"ckpt_path={which!r} chose {outcome.message}"


class Chosen(Exception):
    """Carries the chosen path out of the child."""


def test_a_save_last_link_inside_the_folder_is_still_chosen(honest, tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    target = folder / "epoch=0-step=1.ckpt"
    shutil.copyfile(honest, target)
    (folder / "last.ckpt").symlink_to(target.name)  # what save_last="link" makes: a relative link to a sibling
    assert newest_complete_checkpoint([folder], name_prefix="last") == str(target.resolve())
    assert _resolve(tmp_path, "last") == str(target.resolve())
    assert _resolve(tmp_path, "auto") == str(target.resolve())


def test_last_refuses_the_runs_own_last_link_once_it_leads_outside(honest, tmp_path):
    from phalanx.utilities.exceptions import UnsafeCheckpointError

    folder, outside = tmp_path / "run" / "checkpoints", tmp_path / "elsewhere"
    folder.mkdir(parents=True)
    outside.mkdir()
    shutil.copyfile(honest, outside / "other.ckpt")
    (folder / "last.ckpt").symlink_to(outside / "other.ckpt")  # the save_last="link" link, switched by someone else
    trainer = quiet_trainer(
        default_root_dir=tmp_path / "run",
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=folder, save_last="link")],
    )
    trainer.checkpoint_callback.last_model_path = str(folder / "last.ckpt")
    with pytest.raises(UnsafeCheckpointError, match=r"the link last\.ckpt .* outside the checkpoint directory"):
        trainer._checkpoint_connector.resolve_path("last")
