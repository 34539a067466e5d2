"""Names read from a checkpoint directory, turned into paths that stay inside it.

A checkpoint directory names its own files: DCP's ``.metadata`` names the shard file of every tensor, DeepSpeed's
``latest`` and phalanx's state file name the tag directory. Such a name must be one plain entry of the directory it
is looked up in, and what it points to (after resolving symbolic links) must lie inside the checkpoint directory;
otherwise the load is refused before anything is opened, so a checkpoint cannot make phalanx read (or copy, or
overwrite) a file elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

#: A checkpoint entry (a sentence) saying why a checkpoint written during training holds no ``optimizer_states``, so
#: that resuming from it names the real cause.
OPTIMIZER_OMITTED = "optimizer_states_omitted"


def entry_inside(directory: Path, name: Any, *, root: Path, what: str) -> Path:
    """``directory / name`` resolved, if ``name`` is a plain file name and the result lies inside ``root``."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(mark in name for mark in ("/", "\\", "\0"))
        or os.path.isabs(name)
    ):
        raise UnsafeCheckpointError(
            f"Refusing to read the checkpoint {root}: {what} is {name!r}, which is not a plain file name inside the"
            " checkpoint directory (no '/', '\\', '..', absolute paths or empty names)."
        )
    return path_inside(directory / name, root=root, what=what)


def path_inside(path: str | os.PathLike, *, root: Path, what: str) -> Path:
    """``path`` with symbolic links resolved, if that lies inside ``root`` (the checkpoint directory)."""
    resolved_root = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved != resolved_root and not resolved.is_relative_to(resolved_root):
        raise UnsafeCheckpointError(
            f"Refusing to read the checkpoint {root}: {what} ({path}) leads to {resolved}, "
            "outside the checkpoint directory."
        )
    return resolved


#: How deep the folders of a checkpoint directory may nest (DeepSpeed's tag folder holds files one level down);
#: anything deeper is refused rather than walked (1,500 nested folders exhaust a recursive walk).
MAX_DEPTH = 32


def tree_inside(directory: Path, *, root: Path, what: str) -> None:
    """Refuse if anything under ``directory`` (a symbolic link, at any depth) leads outside ``root``.

    Walked without recursion; folders nested more than ``MAX_DEPTH`` deep are refused with ``CheckpointError``.
    """
    pending: list[tuple[Path, int]] = [(Path(directory), 0)]
    while pending:
        current, depth = pending.pop()
        try:
            with os.scandir(current) as listing:
                entries = list(listing)
        except OSError as error:
            raise CheckpointError(f"{what}: {current} cannot be listed ({error.strerror or error}).") from None
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink():
                path_inside(path, root=root, what=f"{what} entry {path.relative_to(directory)}")
            elif entry.is_dir(follow_symlinks=False):
                if depth + 1 > MAX_DEPTH:
                    raise CheckpointError(
                        f"Refusing to read the checkpoint {root}: {what} nests folders more than {MAX_DEPTH} deep"
                        f" ({path.relative_to(directory).parts[0]}/...); a checkpoint directory is never that deep."
                    )
                pending.append((path, depth + 1))


__all__ = ["MAX_DEPTH", "entry_inside", "path_inside", "tree_inside"]
