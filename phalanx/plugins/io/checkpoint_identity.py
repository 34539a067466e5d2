"""What is stored at a checkpoint's path, in a few words that two processes compare before they both load it.

``checkpoint_identity(path)`` reads no tensor: a file's size and the table of contents of its zip archive (the
format ``torch.save`` writes), whose CRC-32 checksums cover every record, the pickled metadata (step, epoch,
hyper-parameters) and the tensors alike; a file that is no zip archive, by its size and a digest of its first and
last 64 KiB. A directory is described by its files' names and sizes and the same digest of each of its first
``MAX_OPENED`` files (4 KiB edges there). Two copies of one checkpoint (on two nodes' disks) describe alike, whatever
their modification times; two different checkpoints practically never do.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from typing import IO, Any, Callable

#: What a directory's description reads at most: entries listed, and files opened (for a table of contents or edges).
MAX_ENTRIES = 100_000
MAX_OPENED = 256
_EDGE = 64 * 1024  # bytes of a file's beginning and end digested when it is no zip archive
_MEMBER_EDGE = 4 * 1024  # the same for each file of a directory (a sharded checkpoint has many)


def checkpoint_identity(path: str | os.PathLike) -> str:
    """A short description of the checkpoint at ``path`` (a file or a directory; local or an fsspec URL): equal for
    identical checkpoints, different (practically always) otherwise; 'nothing' where nothing is."""
    text = os.fspath(path)
    if "://" in str(text):
        return _url_identity(str(text))
    try:
        info = os.stat(text)
    except FileNotFoundError:
        return "nothing at this path"
    except OSError as error:
        return f"unreadable ({type(error).__name__}: {error.strerror})"
    if stat.S_ISDIR(info.st_mode):
        return _directory_identity(_local_files(text), lambda name: open(os.path.join(text, name), "rb"))
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file or directory"
    with open(text, "rb") as file:
        return f"a file of {info.st_size} bytes, content {_file_digest(file, info.st_size)}"


def _local_files(root: str) -> list[tuple[str, int]]:
    """(relative name, size) of the regular files under ``root``, links not followed, at most MAX_ENTRIES entries."""
    found: list[tuple[str, int]] = []
    pending, seen = [""], 0
    while pending and seen < MAX_ENTRIES:  # a loop, not recursion: a deep tree must not exhaust the stack
        relative = pending.pop()
        with os.scandir(os.path.join(root, relative)) as entries:
            for entry in entries:
                seen += 1
                name = os.path.join(relative, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                elif entry.is_file(follow_symlinks=False):
                    found.append((name, entry.stat(follow_symlinks=False).st_size))
    return found


def _directory_identity(files: list[tuple[str, int]], open_file: Callable[[str], IO[bytes]]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for opened, (name, size) in enumerate(sorted(files)):
        digest.update(f"{name}\0{size}\0".encode())
        if opened < MAX_OPENED:
            with open_file(name) as file:
                digest.update(_file_digest(file, size, _MEMBER_EDGE).encode())
    total = sum(size for _, size in files)
    return f"a directory of {len(files)} files, {total} bytes, content {digest.hexdigest()}"


def _file_digest(file: IO[bytes], size: int, edge: int = _EDGE) -> str:
    table = _zip_table(file) if size >= 22 else None  # a zip archive ends with a 22-byte record at least
    if table is not None:
        return hashlib.blake2b(table, digest_size=8).hexdigest()
    digest = hashlib.blake2b(digest_size=8)
    file.seek(0)
    digest.update(file.read(edge))
    if size > edge:
        file.seek(max(edge, size - edge))
        digest.update(file.read(edge))
    return digest.hexdigest()


def _zip_table(file: IO[bytes]) -> bytes | None:
    """Name, size and CRC-32 of every record of a zip archive (its central directory only); None if not a zip."""
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            parts = [f"{r.filename}\0{r.file_size}\0{r.CRC}".encode() for r in records]
            # torch.save can be told to skip the checksums (CRC 0): then the small pickled metadata itself counts.
            for record in records:
                if record.CRC == 0 and record.filename.endswith("data.pkl") and record.file_size <= 16 * 2**20:
                    parts.append(archive.read(record))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    return b"\n".join(parts)


def _url_identity(url: str) -> str:
    import fsspec  # optional: only URLs need it

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        return "nothing at this path"
    if fs.isdir(root):
        details: dict[str, Any] = fs.find(root, detail=True, maxdepth=None)
        files = [(name[len(root) :].lstrip("/"), int(info.get("size") or 0)) for name, info in details.items()]
        return _directory_identity(files[:MAX_ENTRIES], lambda name: fs.open(f"{root.rstrip('/')}/{name}", "rb"))
    size = int(fs.info(root).get("size") or 0)
    with fs.open(root, "rb") as file:
        return f"a file of {size} bytes, content {_file_digest(file, size)}"
