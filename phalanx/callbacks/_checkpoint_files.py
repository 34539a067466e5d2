"""ModelCheckpoint's file handling: exclusive name claims, and what it may remove.

A checkpoint's callback state is untrusted input (the file may have been tampered with), so every path it names is
checked here before the callback overwrites or removes it: only a ``*.ckpt`` entry directly inside the callback's
folder that is a regular file, or a directory with phalanx's completion marker, is ever removed. Symbolic links are
never followed; the only ones removed are those the callback made itself (``save_last="link"``), and only the link.
"""

from __future__ import annotations

import os
import stat
import uuid
from typing import Any

from phalanx.plugins.io.directory import replace_with, sync_directory

FILE_EXTENSION = ".ckpt"


def is_url(path: Any) -> bool:
    """Whether ``path`` names an fsspec location ('memory://...', 's3://...')."""
    return "://" in str(path)


def exists(path: str) -> bool:
    """Whether something is at ``path`` (a local path or an fsspec URL)."""
    if is_url(path):
        fs, fs_path = _filesystem(path)
        return bool(fs.exists(fs_path))
    return os.path.lexists(path)


def same_location(path: Any, target: str) -> bool:
    """Whether ``path`` (any value) names the same entry as ``target`` (from :func:`checkpoint_in_folder`)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if is_url(path) or is_url(target):
        return str(path).rstrip("/") == target
    return os.path.realpath(path) == os.path.realpath(target)


def resumed_locations(ckpt_path: Any) -> tuple[str, ...]:
    """``ckpt_path`` as given and, for a local path, what it resolves to now (fixed before any link is switched)."""
    if not isinstance(ckpt_path, (str, os.PathLike)) or not os.fspath(ckpt_path):
        return ()
    path = os.fspath(ckpt_path)
    if is_url(path):
        return (str(path).rstrip("/"),)
    return (os.path.abspath(path), os.path.realpath(path))


# ---------------------------------------------------------------------------- what a path is
def _is_checkpoint_name(name: str) -> bool:
    # Hidden names are temporary files and staging directories of atomic writes, never finished checkpoints.
    return name.endswith(FILE_EXTENSION) and len(name) > len(FILE_EXTENSION) and not name.startswith(".")


def checkpoint_in_folder(path: Any, folder: str) -> str | None:
    """``path`` as a ``*.ckpt`` entry directly inside ``folder``, in the form to act on; None when it is not one.

    Local paths: symbolic links and '..' in the parent folders are resolved in order, as the kernel does (so a
    linked folder cannot lead '..' elsewhere); the entry itself is not followed.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        return None
    if is_url(path) or is_url(folder):
        return _url_entry(path, folder)
    name = os.path.basename(path)
    if not _is_checkpoint_name(name):
        return None
    parent = os.path.realpath(os.path.dirname(path) or os.curdir)
    if parent != os.path.realpath(folder):
        return None
    return os.path.join(parent, name)


def _url_entry(path: str, folder: str) -> str | None:
    if not (is_url(path) and is_url(folder)):
        return None
    prefix = folder.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    name = path[len(prefix) :]
    if any(separator in name for separator in ("/", "\\")) or not _is_checkpoint_name(name):
        return None
    return prefix + name


def removal_refusal(target: str, *, may_be_pending: bool, own_link: bool = False) -> str | None:
    """Why ``target`` (from :func:`checkpoint_in_folder`) must not be removed: None when it may, "" when it is absent.

    ``may_be_pending``: the callback wrote ``target`` itself, perhaps through a write still queued (asynchronous IO).
    ``own_link``: the callback made ``target`` as a symbolic link (``save_last="link"``); such a link may be removed
    (:func:`remove_link` removes the link only, never what it points to).
    """
    from phalanx.trainer.checkpoint import COMPLETE_MARKER

    if is_url(target):
        fs, fs_path = _filesystem(target)
        if not fs.exists(fs_path):
            return None if may_be_pending else ""
        if fs.isdir(fs_path) and not fs.isfile(f"{fs_path.rstrip('/')}/{COMPLETE_MARKER}"):
            return f"it is a directory without phalanx's {COMPLETE_MARKER!r} marker, so not a checkpoint"
        return None
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None if may_be_pending else ""
    if stat.S_ISLNK(info.st_mode):
        if own_link:
            return None
        return "it is a symbolic link phalanx did not make in this run (neither the link nor its target is touched)"
    if stat.S_ISDIR(info.st_mode):
        try:
            marker = os.lstat(os.path.join(target, COMPLETE_MARKER))
        except OSError:
            marker = None
        if marker is None or not stat.S_ISREG(marker.st_mode):
            return f"it is a directory without phalanx's {COMPLETE_MARKER!r} marker, so not a checkpoint"
        return None
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    return None


# ---------------------------------------------------------------------------- claiming names
def claim(path: str) -> bool:
    """Create ``path`` as an empty placeholder unless something is there; True when this call created it.

    Local paths use an exclusive create (O_CREAT | O_EXCL), so of several runs naming the same file exactly one wins.
    fsspec URLs use the file system's 'xb' mode, which object stores may implement as check-then-create: there two
    runs can still race. The checkpoint write then replaces the placeholder (a file by rename, a checkpoint directory
    by ``publish_directory``); an empty placeholder is never taken for a complete checkpoint.
    """
    if is_url(path):
        return _claim_url(path)
    os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.close(handle)
    return True


def _claim_url(path: str) -> bool:
    fs, fs_path = _filesystem(path)
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    try:
        with fs.open(fs_path, "xb"):
            pass
    except FileExistsError:
        return False
    except (
        ValueError,
        NotImplementedError,
    ):  # no exclusive mode on this file system: the best left is check-then-create
        if fs.exists(fs_path):
            return False
        fs.touch(fs_path)
    return True


def release(path: str) -> None:
    """Remove a placeholder made by :func:`claim` that no checkpoint replaced (it is still an empty file)."""
    try:
        if is_url(path):
            fs, fs_path = _filesystem(path)
            if fs.isfile(fs_path) and fs.size(fs_path) == 0:
                fs.rm(fs_path)
            return
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_size == 0:
            os.unlink(path)
    except OSError:
        pass  # a placeholder left behind is harmless: it is never resumed from


# ---------------------------------------------------------------------------- last.ckpt as a link
def is_link(path: str) -> bool:
    """Whether ``path`` is a symbolic link (never for fsspec URLs)."""
    return not is_url(path) and os.path.islink(path)


def publish_link(target: str, link: str) -> bool:
    """Make ``link`` a relative symbolic link to ``target`` (both in one folder), replacing what is at ``link``.

    The link is made under a hidden temporary name and renamed over ``link`` in one step, so ``link`` always names a
    complete checkpoint: the old one until the rename, the new one after. A checkpoint directory at ``link`` (which a
    rename cannot replace) is first moved to a *retired* name that resume still considers, and removed once the link
    is in place. Returns False, changing nothing, where this system or file system cannot make links (Windows
    without the privilege, some network file systems).
    """
    folder, name = os.path.split(link)
    temporary = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        os.symlink(os.path.basename(target), temporary)
    except (OSError, NotImplementedError):
        return False
    try:
        replace_with(temporary, link)
    except BaseException:
        remove_link(temporary)
        raise
    sync_directory(folder)
    return True


def points_to(link: str, target: str) -> bool:
    """Whether ``link`` is a symbolic link whose text names ``target``'s file name (as :func:`publish_link` makes)."""
    try:
        return os.readlink(link) == os.path.basename(target)
    except OSError:
        return False


def remove_link(path: str) -> None:
    """Remove the symbolic link at ``path`` (never what it points to); nothing when it is gone or not a link."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _filesystem(path: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(path)
