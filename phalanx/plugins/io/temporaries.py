"""Hidden temporary names that say which process made them, and removing those whose process is gone.

Every atomic write (a file's temporary, a directory checkpoint's staging directory, a link's temporary) goes to a
hidden name ``.NAME.<owner>.<random>.tmp`` beside its target. ``<owner>`` is ``<machine>-<pid>-<start>``: a tag of
the machine (its host name and process-id namespace), the writing process's id, and the clock tick at which that
process started (Linux; 0 elsewhere), which tells the process apart from a later one given the same id.

A save killed mid-write leaves its temporary behind. After each successful save, and when ModelCheckpoint sets up,
:func:`remove_stale_temporaries` removes from that folder the temporaries whose process is gone: made on this machine
by a process that no longer runs (or whose id now belongs to a process started at another time). Temporaries of live
processes (another run saving into the same folder, this process's own writes in flight), of other machines (whose
processes cannot be looked at from here) and of earlier phalanx versions (no owner in the name) are left alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import socket
import stat
import uuid
from typing import Any

#: A temporary of this module: the target's name, the owner's machine tag, process id and start tick, a random id.
_OWNED = re.compile(r"^\.(?P<name>.+)\.(?P<machine>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)\.[0-9a-f]{32}\.tmp$")
#: A temporary of an earlier phalanx (no owner in the name): left alone by the sweep.
_UNOWNED = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.tmp$")


@functools.cache
def _machine() -> str:
    try:  # processes in another pid namespace (another container) cannot be looked at from this one
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


def _start_tick(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); 0 where this cannot be known; None if it is gone or a
    zombie (a killed process its parent has not reaped yet: it writes nothing more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else 0
    except (OSError, IndexError):
        return 0
    if fields[0] == b"Z":
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


_OWN: dict[int, str] = {}


def owner(pid: int | None = None) -> str:
    """The owner tag of process ``pid`` (by default this process's, computed once: a forked child gets its own)."""
    if pid is not None and pid != os.getpid():
        return f"{_machine()}-{pid}-{_start_tick(pid) or 0}"
    pid = os.getpid()
    if pid not in _OWN:
        _OWN[pid] = f"{_machine()}-{pid}-{_start_tick(pid) or 0}"
    return _OWN[pid]


def temporary_name(name: str) -> str:
    """A new hidden temporary name for a write whose target is called ``name``, owned by this process."""
    return f".{name}.{owner()}.{uuid.uuid4().hex}.tmp"


def temporary_target(entry: str) -> str | None:
    """The target name of the temporary called ``entry`` (of this or an earlier phalanx); None if it is none."""
    match = _OWNED.match(entry) or _UNOWNED.match(entry)
    return match.group("name") if match else None


def owner_of(entry: str) -> str | None:
    """The owner tag in the temporary name ``entry`` (``<machine>-<pid>-<start>``); None if it carries none."""
    match = _OWNED.match(entry)
    return f"{match.group('machine')}-{match.group('pid')}-{match.group('start')}" if match else None


def is_stale(entry: str) -> bool:
    """Whether ``entry`` is a temporary whose process is known to be gone (see the module docstring)."""
    match = _OWNED.match(entry)
    if match is None or match.group("machine") != _machine():
        return False
    if owner_of(entry) == owner():
        return False  # this process's own: a write in flight (on another thread) or one it cleans up itself
    pid, start = int(match.group("pid")), int(match.group("start"))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user runs under that id
    except (OSError, OverflowError):
        return False  # cannot tell: keep it
    now = _start_tick(pid)
    return now is None or (start != 0 and now not in (0, start))


def remove_stale_temporaries(folder: Any, *, fs: Any = None) -> list[str]:
    """Remove the stale temporaries (files, links or staging directories) directly in ``folder``: a local path, an
    fsspec URL, or a path of the fsspec file system ``fs``. Returns the names removed. One listing of the folder;
    errors are ignored (what cannot be removed now is tried again by a later sweep)."""
    if fs is not None or "://" in str(folder):
        return _remove_stale_fsspec(folder, fs)
    try:
        entries = os.listdir(os.fspath(folder) or os.curdir)
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not is_stale(entry):
            continue
        path = os.path.join(os.fspath(folder), entry)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except (OSError, RecursionError):
            continue
        removed.append(entry)
    return removed


def _remove_stale_fsspec(folder: Any, fs: Any) -> list[str]:
    removed = []
    try:
        if fs is None:
            import fsspec  # optional: only URLs need it

            fs, folder = fsspec.core.url_to_fs(str(folder))
        names = fs.ls(folder, detail=False)
    except Exception:  # noqa: BLE001 - a listing that fails only leaves the temporaries for a later sweep
        return []
    for path in names:
        entry = str(path).rstrip("/").rsplit("/", 1)[-1]
        if is_stale(entry):
            try:
                fs.rm(path, recursive=True)
            except Exception:  # noqa: BLE001 - best effort, as for local folders
                continue
            removed.append(entry)
    return removed


__all__ = ["is_stale", "owner", "owner_of", "remove_stale_temporaries", "temporary_name", "temporary_target"]
