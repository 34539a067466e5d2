"""One checkpoint file: fsspec URLs, streamed atomic writes and ``weights_only`` reads.

Below ``CheckpointIO`` and every on-disk format: ``TorchCheckpointIO`` writes and reads its files with these, and so do
the directory layouts under ``formats/`` for the files inside a directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

import torch

from phalanx.plugins.io.bounded_reads import (
    _UNSAFE_HINT,
    archive_pickle,
    check_archive,
    check_mapped_records,
    check_tensors,
    disallowed_globals_of_pickle,
    open_checkpoint_file,
    reopenable_path,
)
from phalanx.plugins.io.directory import COMPLETE_MARKER, refuse_unsafe_target, replace_with, sync_directory
from phalanx.plugins.io.temporaries import remove_stale_temporaries, temporary_name
from phalanx.plugins.io.write_failures import describe, free_space, watched_stream
from phalanx.utilities.exceptions import CheckpointError, CheckpointWriteError, UnsafeCheckpointError

if TYPE_CHECKING:
    from phalanx.plugins.io.checkpoint_io import _PathLike

_GLOBAL_REFERENCE = re.compile(r"GLOBAL ([\w.]+)")


def is_url(path: _PathLike) -> bool:
    """Return whether ``path`` names a remote or fsspec location ('s3://...', 'memory://...')."""
    return "://" in str(path)


def _fsspec_filesystem(path: _PathLike, storage_options: Any | None = None) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(str(path), **(storage_options or {}))


def discard(staging: Any) -> None:
    """Remove an unfinished staging directory (best effort: it is hidden and never loaded)."""
    if is_url(staging):
        with contextlib.suppress(Exception):
            fs, root = _fsspec_filesystem(staging)
            if fs.exists(root):
                fs.rm(root, recursive=True)
    else:
        shutil.rmtree(staging, ignore_errors=True)


def _write_local_atomically(write: Callable[[IO[bytes]], None], path: Path) -> None:
    """Run ``write`` on a new temporary file next to ``path``, flush it to the disk, then rename it onto ``path``."""
    refuse_unsafe_target(path)  # a FIFO, a device, a link or a folder there would be replaced by the rename
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(temporary_name(path.name))
    created: list[int] = []

    def exclusively(name: str, flags: int) -> int:
        # A file or link planted under the temporary name is never written through (nor removed on failure).
        descriptor = os.open(name, flags | os.O_EXCL, 0o666)
        created.append(descriptor)
        return descriptor

    try:
        handle = open(temporary, "wb", opener=exclusively)
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # Checks the target again (something may have been put there meanwhile); a checkpoint directory of the same
        # name is moved aside first; the folder's stale temporaries are removed afterwards.
        replace_with(temporary, path)
    except BaseException as error:
        if created:
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno:  # the disk filling, a quota: torch's words name neither
            raise _write_error(path, error, path.parent) from error
        raise
    sync_directory(path.parent)  # the rename is durable only once the directory entry itself is flushed


def _streamed_save(checkpoint: dict[str, Any], path: _PathLike) -> Callable[[IO[bytes]], None]:
    """A writer that runs ``torch.save`` straight into the stream it is given, keeping the stream's first write error.

    torch's zip writer turns any exception of its stream (``OSError``, an interrupt) into "unexpected pos 704 vs 598"
    and ignores a short write's count (leaving a hole): the stream is watched so that a failed save raises its cause,
    named after ``path``.
    """

    def write(handle: IO[bytes]) -> None:
        errors: list[BaseException] = []
        try:
            torch.save(checkpoint, watched_stream(handle, path, errors))
        except Exception:
            if errors:
                raise errors[0] from None
            raise
        if errors:  # a failure torch's writer did not pass on: the file is not whole
            raise errors[0]

    return write


def _write_error(path: _PathLike, error: OSError, folder: Any = None) -> CheckpointWriteError:
    """A failed one-file write (disk full, quota...), naming the file and the cause."""
    if error.filename is None:
        error = OSError(error.errno, error.strerror or str(error), os.fspath(path))
    return CheckpointWriteError(
        f"Could not write the checkpoint {path}: {describe(error)}{free_space(folder) if folder else ''}. Nothing"
        f" was written under that name: the previous checkpoint at {path}, if there is one, is unchanged."
    )


def save_into(checkpoint: dict[str, Any], path: _PathLike) -> None:
    """Write ``checkpoint`` to the new file ``path`` (local or fsspec URL) as it serialises, and flush it to the disk.

    For a file inside a staging directory, which is published whole: no temporary name, no rename of its own.
    """
    write = _streamed_save(checkpoint, path)
    if is_url(path):
        fs, fs_path = _fsspec_filesystem(path)
        with fs.open(fs_path, "wb") as handle:
            write(handle)
        return
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def load_bytes(
    data: bytes | IO[bytes], source: str, map_location: Any | None = None, *, mmap: bool = False
) -> dict[str, Any]:
    """Deserialise a checkpoint with ``weights_only=True``, turning failures into clear errors.

    ``data`` is the checkpoint's bytes or a stream of them; a local file opened by ``open_checkpoint_file`` is read
    by torch from the file itself (never into one buffer), memory-mapped when ``mmap`` is true. Elsewhere (a URL's
    stream, bytes) ``mmap`` is ignored and the records are read one by one from the stream.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    check_archive(stream, source)  # reads the archive's directory only; refuses what could allocate past the file
    # The same open file, by a path torch can open again (its fast reader, and the only way it maps a file).
    target: Any = reopenable_path(stream) or stream
    mmap = mmap and isinstance(target, str)
    if mmap:
        check_mapped_records(stream, source)
    try:
        checkpoint = torch.load(target, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        # Only a reference to a class or function ("GLOBAL pkg.Class") needs arbitrary unpickling; other refusals
        # ("Unsupported operand 0") come from bytes that torch.save did not write, or from a pickle that names its
        # globals in a way torch's reader does not parse (STACK_GLOBAL): those are looked for in the bytes.
        offending = _GLOBAL_REFERENCE.search(str(error))
        # torch names builtins without their module ("GLOBAL eval"): give it back.
        names = [_qualified(offending.group(1))] if offending is not None else _disallowed_globals(stream)
        if names:
            raise UnsafeCheckpointError(
                f"Refusing to load {source}: it references {', '.join(names)}, which is not a tensor or plain value"
                f" and loads only with weights_only=False, i.e. by running arbitrary code. {_UNSAFE_HINT}"
            ) from None
        raise CheckpointError(
            f"{source} is not a checkpoint torch can read (corrupted or not written by torch.save):"
            f" {_first_line(error)}"
        ) from None
    except Exception as error:  # torch raises many types for bytes it cannot parse (IndexError, EOFError, ...)
        raise CheckpointError(
            f"{source} is not a checkpoint torch can read (truncated or not written by torch.save):"
            f" {_first_line(error)}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{source} holds a {type(checkpoint).__name__}, not a checkpoint dictionary.")
    check_tensors(checkpoint, source)
    return checkpoint


def _qualified(name: str) -> str:
    import builtins

    # torch drops the "builtins." of the names it reports ("GLOBAL eval", "GLOBAL str.join"): put it back.
    return f"builtins.{name}" if hasattr(builtins, name.split(".")[0]) else name


def _disallowed_globals(stream: Any) -> list[str]:
    """The globals a refused archive's pickle names that torch's weights-only reader refuses (for messages).

    Only the archive's data.pkl is read (and only when it is of a bounded size): refusing a file never reads it whole.
    """
    return disallowed_globals_of_pickle(archive_pickle(stream))


def _first_line(error: BaseException) -> str:
    """The informative line of ``error``'s message, after its type name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # torch's weights-only errors bury the cause ("Unsupported operand 0") below a paragraph of general advice.
    detail = next(
        (line for line in lines if "Unsupported" in line or "Trying to load" in line), lines[0] if lines else ""
    )
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def _save_to_url(checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None) -> None:
    """Stream ``checkpoint`` into a temporary name through the filesystem's ``open``, then move it onto ``path``."""
    fs, fs_path = _fsspec_filesystem(path, storage_options)
    refuse_unsafe_url_target(fs, fs_path, path)
    parent, _, name = fs_path.rpartition("/")
    if parent:
        fs.makedirs(parent, exist_ok=True)
    temporary = f"{parent}/{temporary_name(name)}" if parent else temporary_name(name)
    try:
        with fs.open(temporary, "wb") as handle:
            _streamed_save(checkpoint, path)(handle)
        fs.mv(temporary, fs_path)
    except BaseException as error:
        # The previous checkpoint at fs_path is untouched; do not leave the partial temporary behind either.
        with contextlib.suppress(Exception):
            if fs.exists(temporary):
                fs.rm(temporary)
        if isinstance(error, OSError) and error.errno:
            raise _write_error(path, error) from error
        raise
    remove_stale_temporaries(parent, fs=fs)


def refuse_unsafe_url_target(fs: Any, fs_path: str, url: Any) -> None:
    """``refuse_unsafe_target`` for an fsspec location: a local file system's path is checked as a local path; on
    others, only a file or a directory with phalanx's completion marker may be replaced."""
    if getattr(fs, "local_file", False):
        refuse_unsafe_target(fs_path)
        return
    try:
        info = fs.info(fs_path)
    except (FileNotFoundError, OSError):
        return
    kind = info.get("type")
    if kind == "directory" and not fs.isfile(f"{fs_path.rstrip('/')}/{COMPLETE_MARKER}"):
        raise CheckpointWriteError(
            f"Refusing to write a checkpoint at {url}: a directory without phalanx's {COMPLETE_MARKER!r} marker is"
            " there, so not a checkpoint phalanx wrote, and replacing it would delete it."
            " Move or remove it yourself, or save under another name."
        )
    if kind not in ("file", "directory") or info.get("islink"):
        raise CheckpointWriteError(
            f"Refusing to write a checkpoint at {url}: an entry of type {kind!r} is there, which the save would"
            " replace. A save replaces only a file or a checkpoint directory phalanx wrote."
            " Move or remove it yourself, or save under another name."
        )


def save_file(checkpoint: dict[str, Any], path: _PathLike, storage_options: Any | None = None) -> None:
    """Write ``checkpoint`` to the file ``path`` (local or fsspec URL) as it serialises, then publish it atomically."""
    if is_url(path):
        _save_to_url(checkpoint, path, storage_options)
    else:
        if storage_options is not None:
            raise TypeError(f"storage_options are only used for fsspec URLs, not for the local path {str(path)!r}.")
        _write_local_atomically(_streamed_save(checkpoint, path), Path(path))


def is_directory(path: _PathLike) -> bool:
    """Whether ``path`` (local or fsspec URL) is a directory; ``FileNotFoundError`` when nothing is there."""
    if is_url(path):
        fs, fs_path = _fsspec_filesystem(path)
        if not fs.exists(fs_path):
            raise FileNotFoundError(f"Checkpoint not found: {path}")
        return bool(fs.isdir(fs_path))
    local = Path(path)
    if not local.exists():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    return local.is_dir()


def load_file(path: _PathLike, map_location: Any | None = None, *, mmap: bool = False) -> dict[str, Any]:
    """Read the checkpoint file at ``path`` (local or fsspec URL) with ``weights_only=True``, record by record.

    ``mmap=True`` maps a local file (see ``TorchCheckpointIO.load_checkpoint``); a URL is read as a stream.
    """
    if map_location is None:
        map_location = "cpu"
    if is_url(path):
        fs, fs_path = _fsspec_filesystem(path)
        with fs.open(fs_path, "rb") as handle:
            seekable = getattr(handle, "seekable", lambda: False)()
            return load_bytes(handle if seekable else handle.read(), str(path), map_location, mmap=mmap)
    with open_checkpoint_file(Path(path), str(path)) as handle:
        return load_bytes(handle, str(path), map_location, mmap=mmap)
