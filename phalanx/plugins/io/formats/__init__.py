"""Every on-disk checkpoint layout phalanx reads, listed once in ``FORMATS``.

Layout detection (``checkpoint_layout``), whole-checkpoint loading (``TorchCheckpointIO`` given a directory, any
strategy resuming from another's directory) and ``phalanx checkpoint consolidate`` all iterate ``FORMATS``, so adding
a layout means adding its module beside these and one ``Format`` entry below. A directory layout's reader keeps every
check of its own (files inside the directory, ``weights_only`` reads, bounded allocations); this list only says which
reader a directory gets.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from phalanx.plugins.io.directory import COMPLETE_MARKER, incomplete
from phalanx.plugins.io.formats import dcp, deepspeed, xla_fsdp
from phalanx.plugins.io.formats.dcp_metadata import DCP_METADATA_FILE
from phalanx.utilities.exceptions import CheckpointError


@dataclasses.dataclass(frozen=True)
class Format:
    """One on-disk checkpoint layout: its name, how to recognise it and how to read it whole."""

    #: What ``checkpoint_layout`` returns for it ("file", "sharded", ...).
    name: str
    #: How messages name it, with its article: "a sharded (DCP)", "an xla_fsdp".
    title: str
    #: The files that make a directory this layout (besides the ``.complete`` marker); empty for a single file.
    files: tuple[str, ...]
    #: Whether a local path holds this layout (its files present; it reads nothing it need not).
    detect: Callable[[Path], bool]
    #: The whole checkpoint (whole tensors, no process group) read from a local path of this layout; None where
    #: another reader loads it (the single file, which ``CheckpointIO.load_checkpoint`` reads itself).
    load_whole: Callable[[Path], dict[str, Any]] | None
    #: The file of a directory layout that holds the Trainer's state (``global_step``, the fit loop's counters), from
    #: which ``ckpt_path="auto"`` reads how far a checkpoint got; None for the single file (read itself).
    state_file: str | None = None

    @property
    def is_directory(self) -> bool:
        """Whether this layout is a directory (one that ``phalanx checkpoint consolidate`` turns into a file)."""
        return bool(self.files)


FILE = Format("file", "a single-file", (), os.path.isfile, None)
SHARDED = Format(
    "sharded",
    "a sharded (DCP)",
    (DCP_METADATA_FILE, dcp.META_FILE),
    dcp.is_sharded_checkpoint,
    dcp.load_whole,
    dcp.META_FILE,
)
DEEPSPEED = Format(
    "deepspeed",
    "a DeepSpeed",
    (deepspeed.STATE_FILE, "latest"),
    deepspeed.is_deepspeed_checkpoint,
    deepspeed.load_deepspeed_checkpoint_as_full,
    deepspeed.STATE_FILE,
)
# xla_fsdp's sharded layout: the rest are the replicas' piece files, which its meta file lists.
XLA_FSDP = Format(
    "xla_fsdp",
    "an xla_fsdp",
    (xla_fsdp.META_FILE,),
    xla_fsdp.is_xla_fsdp_checkpoint,
    xla_fsdp.consolidate_xla_fsdp,
    xla_fsdp.META_FILE,
)

#: Every layout, in the order they are tried.
FORMATS: list[Format] = [FILE, SHARDED, DEEPSPEED, XLA_FSDP]


def directory_formats() -> list[Format]:
    """The directory layouts of ``FORMATS``, read at call time (a layout added to the list is found everywhere)."""
    return [entry for entry in FORMATS if entry.is_directory]


def detect_directory(path: str | os.PathLike) -> Format | None:
    """The directory layout the local ``path`` holds, or None (no check of completeness: see ``checkpoint_layout``)."""
    directory = Path(path)
    return next((entry for entry in directory_formats() if entry.detect(directory)), None)


def not_a_checkpoint(path: str | os.PathLike) -> CheckpointError:
    """The error for a local directory no layout recognises: which files a layout misses, or every layout's name."""
    directory = Path(path)
    for entry in directory_formats():
        present = [name for name in entry.files if (directory / name).exists()]
        if present and len(present) < len(entry.files):
            missing = [name for name in entry.files if name not in present]
            return CheckpointError(
                f"{directory} looks like {entry.title} checkpoint ({', '.join(present)}) but is missing"
                f" {', '.join(missing)}: it is incomplete or damaged."
            )
    return CheckpointError(f"{directory} is a directory but not a checkpoint phalanx can read: not {_titles()}.")


def _titles() -> str:
    """ "a sharded (DCP) checkpoint, a DeepSpeed one or an xla_fsdp one": every directory layout by name."""
    titles = [entry.title for entry in directory_formats()]
    named = [f"{titles[0]} checkpoint", *(f"{title} one" for title in titles[1:])]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"


def consolidate(path: str | os.PathLike) -> dict[str, Any]:
    """One ordinary phalanx checkpoint from a local checkpoint directory of any layout in ``FORMATS``.

    As for ``fit``, a directory without its ``.complete`` marker (a save that did not finish) is refused.
    """
    directory = Path(path)
    entry = detect_directory(directory)
    if entry is None or entry.load_whole is None:
        raise not_a_checkpoint(directory)
    if not os.path.lexists(directory / COMPLETE_MARKER):
        raise incomplete(directory, entry.name)
    return entry.load_whole(directory)


__all__ = ["FORMATS", "Format", "consolidate", "detect_directory", "directory_formats", "not_a_checkpoint"]
