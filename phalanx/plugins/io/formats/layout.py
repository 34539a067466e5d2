"""Which layout a checkpoint path holds: one file, a sharded (DCP) directory, a DeepSpeed directory or xla_fsdp's
sharded directory.

Every strategy's ``load_checkpoint`` asks ``checkpoint_layout`` first, for local paths and fsspec URLs alike, so that
the three layouts follow one rule: a directory is a checkpoint only once its ``.complete`` marker is there.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from phalanx.utilities.exceptions import CheckpointError

Layout = Literal["file", "sharded", "deepspeed", "xla_fsdp"]
LAYOUTS: tuple[str, ...] = ("file", "sharded", "deepspeed", "xla_fsdp")

#: The files that make a directory one layout or the other (besides the ``.complete`` marker written last).
_LAYOUT_FILES: dict[str, tuple[str, ...]] = {
    "sharded": (".metadata", "phalanx_meta.pt"),
    "deepspeed": ("phalanx_deepspeed_state.pt", "latest"),
    "xla_fsdp": ("phalanx_xla_fsdp.pt",),  # xla_fsdp's sharded layout: the rest are the replicas' piece files
}


def checkpoint_layout(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Layout:
    """The layout of the checkpoint at ``path`` (local path or fsspec URL).

    Raises ``FileNotFoundError`` when nothing is there and ``CheckpointError`` (naming the path and what is missing)
    for a directory that is not a complete checkpoint: one whose save has not finished is never loaded.
    """
    from phalanx.plugins.io.directory import COMPLETE_MARKER
    from phalanx.plugins.io.torch_io import _fsspec_filesystem, is_url

    if is_url(path):
        fs, root = _fsspec_filesystem(path, storage_options)
        exists, isdir = fs.exists, fs.isdir
        join = lambda name: f"{root.rstrip('/')}/{name}"  # noqa: E731
    else:
        root = os.fspath(path)
        exists, isdir = os.path.exists, os.path.isdir
        join = lambda name: os.path.join(root, name)  # noqa: E731
    if not exists(root):
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    if not isdir(root):
        return "file"
    present = {name for names in _LAYOUT_FILES.values() for name in names if exists(join(name))}
    for layout, names in _LAYOUT_FILES.items():
        if all(name in present for name in names):
            if not exists(join(COMPLETE_MARKER)):
                raise CheckpointError(
                    f"{path} is an incomplete {layout} checkpoint: it has no {COMPLETE_MARKER} marker (written last,"
                    " once every rank finished), so its save did not finish. Resume from an earlier checkpoint."
                )
            return layout  # type: ignore[return-value]
    found = sorted(present)
    raise CheckpointError(
        f"{path} is a directory but not a complete checkpoint: a sharded one holds"
        f" {', '.join(_LAYOUT_FILES['sharded'])}, a DeepSpeed one {', '.join(_LAYOUT_FILES['deepspeed'])}, an xla_fsdp"
        f" one {', '.join(_LAYOUT_FILES['xla_fsdp'])} (found: {', '.join(found) if found else 'none of them'})."
    )
