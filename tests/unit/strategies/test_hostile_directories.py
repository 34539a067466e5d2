"""Hostile DeepSpeed and xla_fsdp checkpoint directories against every reader, each run in a child with an
address-space limit and an alarm (tests/bounded_child.py): names and numbers that claim more ranks than files, files
of a few KB whose tensors claim gigabytes, the same bytes claimed by many tensors, links leading outside, FIFOs.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from bounded_child import Outcome, run_bounded
from checkpoint_attacks import consolidate_through_cli
from test_xla_fsdp_checkpoint import write

from phalanx.plugins.io.formats.xla_fsdp import META_FILE, consolidate_xla_fsdp, read_own_pieces, shard_file
from phalanx.plugins.io.torch_io import TorchCheckpointIO

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected pickle protocol 4"),
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's"),
]

CLAIM = 1 << 29  # elements a hostile tensor claims: more than the child's address-space headroom
ALIASES = 6000  # tensors made of the same stored bytes (small ones: each copy stays on one thread in the child)


def _assert_refused(outcome: Outcome, message: str) -> None:
    assert outcome.error in ("CheckpointError", "UnsafeCheckpointError", "CliError"), str(outcome)
    assert re.search(message, outcome.message), str(outcome)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link_outside(path: Path) -> None:
    outside = path.parent.parent / f"outside-{path.name}"
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)


# ---------------------------------------------------------------------------- xla_fsdp
def _tamper(path: Path, file: str, change: Callable[[dict[str, Any]], None]) -> None:
    content = torch.load(path / file, weights_only=True)
    change(content)
    torch.save(content, path / file)


def _huge_parameter(pieces: Callable[[], torch.Tensor], count: int, numel: int) -> Callable[[Path], None]:
    """Layout and both replicas' files gain ``count`` parameters of ``2 * numel`` elements, pieces from ``pieces``."""

    def attack(path: Path) -> None:
        names = [f"huge.{index}" for index in range(count)]
        entry = {"shape": [2 * numel], "piece": [numel]}
        _tamper(path, META_FILE, lambda meta: meta["xla_fsdp_shards"]["parameters"].update(dict.fromkeys(names, entry)))
        for rank in range(2):
            named = dict.fromkeys(names, pieces())  # one tensor object: torch.save writes its bytes once
            _tamper(path, shard_file(rank, 2), lambda state, named=named: state["state_dict"].update(named))

    return attack


# name -> (the attack, what the refusal says, whether a replica reading its own pieces meets it)
XLA_ATTACKS: dict[str, tuple[Callable[[Path], None], str, bool]] = {
    "the meta file links outside": (lambda p: _link_outside(p / META_FILE), r"outside the checkpoint directory", True),
    "a replica's file links outside": (
        lambda p: _link_outside(p / shard_file(1, 2)),
        r"outside the checkpoint directory",
        True,
    ),
    "the meta file is a FIFO": (
        lambda p: _fifo(p / META_FILE),
        r"named pipe \(FIFO\), not a regular file",
        True,
    ),
    "a replica's file is a FIFO": (
        lambda p: _fifo(p / shard_file(1, 2)),
        r"named pipe \(FIFO\), not a regular file",
        True,
    ),
    "pieces of one element expanded to 2**29": (
        _huge_parameter(lambda: torch.zeros(1).expand(CLAIM), 1, CLAIM),
        r"claims 536870912 elements",
        True,
    ),
    "one stored piece named by 6000 parameters": (
        _huge_parameter(lambda: torch.zeros(1 << 13), ALIASES, 1 << 13),
        r"Refusing to consolidate .* \(4 times the \d+ bytes its files hold\)",
        False,
    ),
}

XLA_READERS: dict[str, Callable[[Path, Path], Any]] = {
    "consolidate_xla_fsdp": lambda path, tmp: consolidate_xla_fsdp(path),
    "TorchCheckpointIO of the directory": lambda path, tmp: TorchCheckpointIO().load_checkpoint(path),
    "cli consolidate": consolidate_through_cli,
    "a replica's own pieces": lambda path, tmp: read_own_pieces(
        path, rank=1, world_size=2, read=TorchCheckpointIO().load_checkpoint
    ),
}


@pytest.mark.parametrize("reader", list(XLA_READERS))
@pytest.mark.parametrize("attack", list(XLA_ATTACKS))
def test_a_hostile_xla_fsdp_directory_is_refused_within_bounded_memory_and_time(tmp_path, attack, reader):
    make, message, own_pieces_too = XLA_ATTACKS[attack]
    if reader == "a replica's own pieces" and not own_pieces_too:
        pytest.skip("a replica reads its own pieces as they are: nothing is built from them")
    path = tmp_path / "run" / "x.ckpt"
    assert write(path, 2) == [None, None]
    make(path)
    _assert_refused(run_bounded(lambda: XLA_READERS[reader](path, tmp_path)), message)


def test_links_inside_an_xla_fsdp_directory_are_fine(tmp_path):
    path = tmp_path / "x.ckpt"
    assert write(path, 2) == [None, None]
    (path / "moved.pt").write_bytes((path / shard_file(1, 2)).read_bytes())
    (path / shard_file(1, 2)).unlink()
    (path / shard_file(1, 2)).symlink_to("moved.pt")
    whole = consolidate_xla_fsdp(path)
    assert whole["state_dict"]["net.0.weight"].shape == (5, 3)
