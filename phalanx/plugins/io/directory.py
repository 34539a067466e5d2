"""Checkpoint directories that appear whole or not at all (sharded and DeepSpeed checkpoints).

Every rank writes its part into one hidden staging directory next to the target; once all have finished, rank 0
writes the completion marker and puts the staging directory in place of the target. At every instant a complete
checkpoint of that name can be found by ``ckpt_path="auto"``:

- On Linux the staging directory and the old checkpoint trade places in one ``renameat2(RENAME_EXCHANGE)`` call, so
  the name never stops pointing at a complete checkpoint.
- Where that call is unavailable (another OS, a file system without it), the old checkpoint is first renamed to a
  *retired* name (``.NAME.<hex>.retired``), still complete and marked, which resume considers like any other
  checkpoint until the new one is in place; then the staging directory is renamed to ``NAME``.

A hidden staging directory, or a directory without its marker, is never chosen by ``ckpt_path="auto"``.

A save puts its checkpoint only where nothing is, or in place of a regular file, a checkpoint directory phalanx wrote
(one with the marker) or a link phalanx made (``save_last="link"``'s, naming a checkpoint beside it):
``refuse_unsafe_target`` refuses anything else (a FIFO, a device such as /dev/null, a socket, another link, a
folder of the user's) before anything is written, since the rename that publishes a checkpoint would replace it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from phalanx.plugins.io.temporaries import remove_stale_temporaries, temporary_name
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError

#: Written last into a directory checkpoint, once every rank has written its part.
COMPLETE_MARKER = ".complete"
_RETIRED = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.retired$")


def incomplete(path: str | os.PathLike, layout: str) -> CheckpointError:
    """The refusal of a ``layout`` checkpoint directory at ``path`` that has no ``.complete`` marker."""
    return CheckpointError(
        f"{path} is an incomplete {layout} checkpoint: it has no {COMPLETE_MARKER} marker (written last, once every"
        " rank finished), so its save did not finish. Resume from an earlier checkpoint."
    )


def require_complete(path: Any, layout: str, files: tuple[str, ...]) -> None:
    """Refuse ``path`` (local or fsspec URL) unless it is a directory holding ``files`` and the ``.complete`` marker.

    For a reader that knows its layout already; ``formats.layout.checkpoint_layout`` finds the layout of any path.
    """
    if "://" in str(path):
        import fsspec  # optional: only URLs need it

        fs, root = fsspec.core.url_to_fs(str(path))
        exists = lambda name: fs.exists(f"{root.rstrip('/')}/{name}")  # noqa: E731
    else:
        exists = lambda name: os.path.exists(os.path.join(os.fspath(path), name))  # noqa: E731
    missing = [name for name in files if not exists(name)]
    if missing:
        raise CheckpointError(f"{path} is not {layout}'s checkpoint directory: it has no {', '.join(missing)}.")
    if not exists(COMPLETE_MARKER):
        raise incomplete(path, layout)


def staging_directory(target: Path, *, is_global_zero: bool, broadcast: Callable[[Any], Any]) -> Path:
    """The hidden directory next to ``target`` that every rank writes into (rank 0 names it, all ranks agree).

    Rank 0 first checks that a checkpoint may be put at ``target`` (``refuse_unsafe_target``); every rank raises its
    refusal, before anything is written.
    """
    named: tuple[str | None, str | None] = (None, None)
    if is_global_zero:
        try:
            refuse_unsafe_target(target)
            named = (str(target.with_name(temporary_name(target.name))), None)
        except CheckpointWriteError as error:
            named = (None, str(error))
    name, refusal = broadcast(named)
    if refusal is not None:
        raise CheckpointWriteError(refusal)
    return Path(name)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to the disk."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _marked(directory: str | os.PathLike) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(directory, COMPLETE_MARKER)).st_mode)
    except OSError:
        return False


def is_own_link(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a symbolic link as phalanx makes them (``save_last="link"``): its text is the plain name of
    an entry beside it that is a regular file or a marked checkpoint directory."""
    try:
        text = os.readlink(os.fspath(path))
    except (OSError, ValueError):
        return False
    if text in ("", ".", "..") or any(mark in text for mark in ("/", "\\", "\0")):
        return False
    sibling = os.path.join(os.path.dirname(os.fspath(path)), text)
    try:
        mode = os.lstat(sibling).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and _marked(sibling))


_NOT_FILES = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def target_refusal(target: str | os.PathLike) -> str | None:
    """What is at ``target`` that a save must not replace, in words; None when nothing is there, or a regular file, a
    checkpoint directory phalanx wrote or a link phalanx made (links are not followed)."""
    try:
        mode = os.lstat(target).st_mode
    except (OSError, ValueError):
        return None  # nothing there (or a path the write itself will refuse, naming the cause)
    if stat.S_ISREG(mode) or (stat.S_ISLNK(mode) and is_own_link(target)):
        return None
    if stat.S_ISDIR(mode):
        return None if _marked(target) else f"a directory without phalanx's {COMPLETE_MARKER!r} marker"
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(os.fspath(target))} that phalanx did not make"
        except OSError:
            return "a symbolic link that phalanx did not make"
    return next((kind for test, kind in _NOT_FILES if test(mode)), "not a regular file")


def refuse_unsafe_target(target: str | os.PathLike) -> None:
    """Raise ``CheckpointWriteError`` unless a save may put a checkpoint at the local path ``target``.

    The rename that publishes a checkpoint replaces whatever is at its name: a FIFO, a device (/dev/null, run as
    root), a socket, a link to anything or a folder of the user's would be replaced (or deleted). Call this before
    anything is written, and again just before the rename.
    """
    reason = target_refusal(target)
    if reason is not None:
        raise CheckpointWriteError(
            f"Refusing to write a checkpoint at {os.fspath(target)}: {reason} is there, which the save would replace."
            " A save replaces only a regular file, a checkpoint directory phalanx wrote (with its .complete marker)"
            " or a link phalanx made (save_last='link'). Move or remove it yourself, or save under another name."
        )


def publish_directory(staging: Path, target: Path) -> None:
    """Mark the finished ``staging`` directory complete and put it at ``target`` (on rank 0, after every rank wrote);
    then remove the temporaries that killed saves left in its folder (``temporaries``)."""
    refuse_unsafe_target(target)
    write_synced(staging / COMPLETE_MARKER, b"")
    sync_directory(staging)
    if target.is_dir() and not target.is_symlink() and exchange_paths(staging, target):
        # ``staging`` now holds the previous checkpoint.
        sync_directory(target.parent)
        _remove(staging)
    else:
        retired = None
        if target.exists() or target.is_symlink():
            retired = target.with_name(f".{target.name}.{uuid.uuid4().hex}.retired")
            os.replace(target, retired)
            sync_directory(target.parent)
        os.replace(staging, target)
        sync_directory(target.parent)
        if retired is not None:
            _remove(retired)
    for stale in retired_copies(target.parent, name=target.name):
        _remove(stale)  # left by a save killed between its two renames; the new checkpoint supersedes it
    remove_stale_temporaries(target.parent)


def replace_with(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the file or link ``new`` over ``target``; a directory at ``target`` (which a rename cannot replace) is
    first moved to a *retired* name, which resume still considers, and removed once ``new`` is in place. Only what a
    save may replace is (``refuse_unsafe_target``); the folder's stale temporaries are removed afterwards."""
    refuse_unsafe_target(target)
    folder, name = os.path.split(os.fspath(target))
    if os.path.isdir(target) and not os.path.islink(target):
        retired = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.retired")
        os.replace(target, retired)
        os.replace(new, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(new, target)
    remove_stale_temporaries(folder or os.curdir)


def retired_copies(directory: Path, *, name: str | None = None) -> list[Path]:
    """Previous checkpoints moved aside by a save that replaces them (all of ``directory``'s, or those of ``name``)."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _RETIRED.match(entry.name)
        if match and (name is None or match.group("name") == name):
            found.append(entry)
    return found


def is_retired_copy(path: Path) -> bool:
    """Whether ``path`` is a previous checkpoint moved aside by a save that replaces it."""
    return _RETIRED.match(path.name) is not None


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2``); ``False`` where this system cannot."""
    rename = _renameat2()
    if rename is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if rename(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # the kernel or this file system does not offer the exchange: fall back to two renames
    raise OSError(code, f"Could not swap {first} and {second}: {os.strerror(code)}")


_RENAMEAT2: list[Any] = []


def _renameat2() -> Any:
    if not _RENAMEAT2:
        function = None
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).renameat2
                function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                function.restype = ctypes.c_int
            except (OSError, AttributeError):
                function = None  # a C library older than glibc 2.28, or not glibc
        _RENAMEAT2.append(function)
    return _RENAMEAT2[0]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def sync_directory(directory: str | os.PathLike) -> None:
    """Flush ``directory``'s entries: a rename inside it is durable only then (best effort; errors are ignored)."""
    try:
        handle = os.open(os.fspath(directory) or os.curdir, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
