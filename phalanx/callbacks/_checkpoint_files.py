"""ModelCheckpoint's file handling: exclusive name claims (hidden markers), and what it may remove.

A checkpoint's callback state is untrusted input (the file may have been tampered with), so every path it names is
checked here before the callback overwrites or removes it: only a ``*.ckpt`` entry directly inside the callback's
folder that is a regular file, or a directory with phalanx's completion marker, is ever removed. Symbolic links are
never followed; the only ones removed are those the callback made itself (``save_last="link"``), and only the link.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: claims are exclusive creates, without a lock
    fcntl = None  # type: ignore[assignment]

from phalanx.plugins.io.directory import COMPLETE_MARKER, refuse_unsafe_target, replace_with, sync_directory
from phalanx.plugins.io.temporaries import (
    is_stale,
    owner_of,
    remove_stale_temporaries,
    temporary_name,
    temporary_target,
)

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
#: A name is claimed by a hidden marker beside it (``.NAME.claim``): the name itself appears only once its checkpoint
#: is whole (a write goes to a hidden temporary and is renamed), so a killed save never leaves it empty.
CLAIM_SUFFIX = ".claim"


class Claim:
    """A name this process reserved (see :func:`claim`), held until its checkpoint is written or its save failed."""

    def __init__(self, path: str, marker: str, handle: int | None) -> None:
        self.path, self._marker, self._handle = path, marker, handle
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the name back: remove the marker, then drop its lock (at most once; from any thread)."""
        with self._lock:
            marker, self._marker = self._marker, ""
            if not marker:
                return
            try:
                if is_url(marker):
                    fs, fs_path = _filesystem(marker)
                    if fs.exists(fs_path):
                        fs.rm(fs_path)
                else:
                    os.unlink(marker)  # while locked: a claimer that locks it next finds it unlinked and starts over
            except OSError:
                pass  # a marker left behind only hides the name until the next run finds it unlocked and reclaims it
            finally:
                if self._handle is not None:
                    os.close(self._handle)
                    self._handle = None


def claim_marker(path: str) -> str:
    """The hidden marker that claims ``path`` (beside it)."""
    if is_url(path):
        folder, _, name = path.rstrip("/").rpartition("/")
        return f"{folder}/.{name}{CLAIM_SUFFIX}"
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{CLAIM_SUFFIX}")


def claim(path: str) -> Claim | None:
    """Reserve ``path`` for this process unless something is there or another live save holds it; None if not.

    The reservation is a hidden marker, ``.NAME.claim``, locked (``flock``) while this process holds it: of several
    runs naming the same file exactly one wins, and a marker whose holder was killed is unlocked, so the next run
    reclaims the name (removing what the killed save left: its marker and hidden temporaries). Without ``flock``
    (Windows) the marker is an exclusive create and a killed save's marker keeps its name. fsspec URLs use the file
    system's 'xb' mode, which object stores may implement as check-then-create: there two runs can still race.
    """
    if is_url(path):
        return _claim_url(path)
    os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
    marker = claim_marker(path)
    if fcntl is None:
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return None
        if os.path.lexists(path):
            os.unlink(marker)
            return None
        return Claim(path, marker, None)
    handle = _locked(marker)
    if handle is None:
        return None  # a live save holds the name
    if os.path.lexists(path):  # written already (its writer has released it, or never claimed it)
        Claim(path, marker, handle).release()
        return None
    remove_leftovers(path)  # of a save of this name that was killed: nobody else can be writing it now
    return Claim(path, marker, handle)


def _locked(marker: str) -> int | None:
    """An open handle to ``marker``, created if need be and locked by this call; None when another holds the lock."""
    while True:
        try:  # never through a link planted in the folder: that would create a file wherever it points
            handle = os.open(marker, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(handle)
            return None
        try:
            same = os.path.samestat(os.fstat(handle), os.lstat(marker))
        except FileNotFoundError:
            same = False
        if same:
            return handle
        os.close(handle)  # its holder finished and unlinked it between our open and our lock: try the new one


def remove_leftovers(path: str) -> None:
    """Remove the hidden temporaries (files, links or staging directories) a killed save of ``path`` left."""
    folder, name = os.path.split(path)
    try:
        entries = os.listdir(folder or os.curdir)
    except OSError:
        return
    for entry in entries:
        if temporary_target(entry) != name or (owner_of(entry) is not None and not is_stale(entry)):
            continue  # not a temporary of this name, or one of a process that still runs (its write in flight)
        leftover = os.path.join(folder, entry)
        if os.path.isdir(leftover) and not os.path.islink(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(leftover)


def reclaim_abandoned(folder: str) -> None:
    """Remove every claim in ``folder`` whose holder is gone (a killed run), with the temporaries of its save, and
    every temporary whose process is gone (see ``phalanx.plugins.io.temporaries``)."""
    remove_stale_temporaries(folder)
    if is_url(folder) or fcntl is None:
        return
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith(".") and entry.endswith(CLAIM_SUFFIX)):
            continue
        name = entry[1 : -len(CLAIM_SUFFIX)]
        marker = os.path.join(folder, entry)
        handle = _locked(marker) if not os.path.islink(marker) else None
        if handle is not None:
            remove_leftovers(os.path.join(folder, name))
            Claim(os.path.join(folder, name), marker, handle).release()


def _claim_url(path: str) -> Claim | None:
    fs, fs_path = _filesystem(path)
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if fs.exists(fs_path):
        return None
    marker = claim_marker(path)
    _, marker_path = _filesystem(marker)
    try:
        with fs.open(marker_path, "xb"):
            pass
    except FileExistsError:
        return None
    except (
        ValueError,
        NotImplementedError,
    ):  # no exclusive mode on this file system: the best left is check-then-create
        if fs.exists(marker_path):
            return None
        fs.touch(marker_path)
    if fs.exists(fs_path):
        Claim(path, marker, None).release()
        return None
    return Claim(path, marker, None)


# ---------------------------------------------------------------------------- last.ckpt as a link
def is_link(path: str) -> bool:
    """Whether ``path`` is a symbolic link (never for fsspec URLs)."""
    return not is_url(path) and os.path.islink(path)


def can_link(folder: str) -> bool:
    """Whether symbolic links can be made in ``folder`` (tried with a hidden link, removed at once)."""
    probe = os.path.join(folder, temporary_name("link-probe"))
    try:
        os.symlink("absent", probe)
    except (OSError, NotImplementedError):
        return False
    remove_link(probe)
    return True


def publish_link(target: str, link: str) -> None:
    """Make ``link`` a relative symbolic link to ``target`` (both in one folder), replacing what is at ``link``.

    The link is made under a hidden temporary name and renamed over ``link`` in one step, so ``link`` always names a
    complete checkpoint: the old one until the rename, the new one after (call this once ``target`` is written). A
    checkpoint directory at ``link`` (which a rename cannot replace) is first moved to a *retired* name that resume
    still considers, and removed once the link is in place; anything else phalanx did not write is refused.
    """
    refuse_unsafe_target(link)  # before the temporary link is made (replace_with checks again)
    folder, name = os.path.split(link)
    temporary = os.path.join(folder, temporary_name(name))
    os.symlink(os.path.basename(target), temporary)
    try:
        replace_with(temporary, link)
    except BaseException:
        remove_link(temporary)
        raise
    sync_directory(folder)


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
