"""Why a checkpoint write failed, in words: the disk filling, a quota, a short write, with the file's path.

torch's zip writer turns an ``OSError`` raised by the stream it writes to into its own ``RuntimeError`` ("unexpected
pos 704 vs 598"), which names neither the cause nor the file. The streams DCP writes through are therefore watched
(:func:`watch_writes`): the first ``OSError`` or short write is kept, with its path, and a failed save names it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Any


class _WatchedStream:
    """A writable stream that records the ``OSError`` (or short write) of its writes before passing them on."""

    def __init__(self, stream: Any, path: Any, errors: list[OSError]) -> None:
        self._stream, self._path, self._errors = stream, path, errors

    def _note(self, error: OSError) -> None:
        if not self._errors:  # the first one is the cause; later ones follow from it
            filename = error.filename if error.filename is not None else os.fspath(self._path)
            self._errors.append(OSError(error.errno, error.strerror or str(error), filename))

    def write(self, data: Any) -> Any:
        try:
            written = self._stream.write(data)
        except OSError as error:
            self._note(error)
            raise
        size = memoryview(data).nbytes
        if isinstance(written, int) and written < size:  # a caller that ignores the count would leave a hole
            self._note(OSError(errno.EIO, f"short write ({written} of {size} bytes reached the file)"))
            raise self._errors[0]
        return written

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._note(error)
            raise

    def close(self) -> None:
        try:
            self._stream.close()
        except OSError as error:
            self._note(error)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _WatchedStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _FullyWatchedStream(_WatchedStream):
    """A watched stream that also keeps any other exception of its writes (an interrupt), which torch's zip writer
    would otherwise turn into its "unexpected pos" ``RuntimeError``."""

    def write(self, data: Any) -> Any:
        try:
            return super().write(data)
        except OSError:
            raise
        except BaseException as error:
            if not self._errors:
                self._errors.append(error)  # type: ignore[arg-type]  # the list holds any exception here
            raise


def watched_stream(stream: Any, path: Any, errors: list[BaseException]) -> Any:
    """``stream``, recording into ``errors`` the first exception of its writes: an ``OSError`` or a short write
    named after ``path``, or any other exception (an interrupt) as it was."""
    return _FullyWatchedStream(stream, path, errors)  # type: ignore[arg-type]


def watch_writes(writer: Any) -> list[OSError]:
    """Make the DCP storage ``writer`` record its streams' first write error; return the list it goes to."""
    errors: list[OSError] = []
    create_stream = writer.fs.create_stream

    @contextlib.contextmanager
    def watched(path: Any, mode: str) -> Any:
        with create_stream(path, mode) as stream:
            yield _WatchedStream(stream, path, errors) if "r" not in mode else stream

    writer.fs.create_stream = watched
    return errors


def raise_recorded(recorded: list[OSError]) -> None:
    """Raise the write error ``recorded`` holds, if any: a save whose writer went on after it is not whole."""
    if recorded:
        raise recorded[0]


def causes(error: BaseException) -> list[BaseException]:
    """``error``, the per-rank failures DCP wrapped into it, and their causes, innermost last."""
    from torch.distributed.checkpoint.api import CheckpointException

    found: list[BaseException] = []
    pending = [error]
    while pending and len(found) < 32:
        current = pending.pop(0)
        if current in found:
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            pending.extend(
                failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()
            )
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found


def root_cause(error: BaseException, recorded: list[OSError] | None = None) -> BaseException:
    """The error that explains ``error``: a recorded write error, else the first ``OSError`` with an errno in it."""
    if recorded:
        return recorded[0]
    found = causes(error)
    return next((e for e in found if isinstance(e, OSError) and e.errno), found[-1])


def describe(error: BaseException) -> str:
    """``error`` in one phrase: 'No space left on device [ENOSPC] (path)', or its type and last line."""
    if isinstance(error, OSError) and error.errno:
        where = f" ({error.filename})" if error.filename else ""
        reason = error.strerror if error.errno == errno.EIO and error.strerror else os.strerror(error.errno)
        return f"{reason} [{errno.errorcode.get(error.errno, error.errno)}]{where}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def free_space(folder: Any) -> str:
    """'; N bytes are free on its file system', or '' where that cannot be known (a URL, a missing folder)."""
    try:
        return f"; {shutil.disk_usage(folder).free} bytes are free on its file system"
    except (OSError, TypeError, ValueError):
        return ""


__all__ = ["causes", "describe", "free_space", "raise_recorded", "root_cause", "watch_writes", "watched_stream"]
