"""Reading checkpoint files so that a file cannot make phalanx wait forever or allocate memory it does not hold.

Every local checkpoint file phalanx reads (single files, DeepSpeed's and xla_fsdp's files, a sharded checkpoint's
state file) is opened by ``open_checkpoint_file``: only a regular file is read (a FIFO would block the reader, a
device such as /dev/zero never ends). ``check_archive`` looks at a torch.save zip archive's directory before torch
reads it: every entry stored uncompressed, all of them together no larger than the file (a compressed or overlapping
entry would make torch allocate more than the file holds). ``check_tensors`` looks at every tensor torch built: it
must not claim more elements than its storage holds (torch accepts a one-element storage viewed with stride 0 as any
number of elements, which the first copy or concatenation then allocates). ``AllocationBudget`` bounds what
consolidation allocates by the bytes the files it read hold.
"""

from __future__ import annotations

import contextvars
import io
import os
import stat
import zipfile
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator

import torch

from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

#: At most this much of a refused file is read to name the globals it references (for the message only).
MESSAGE_SCAN_BYTES = 1 << 20
#: Consolidation may allocate this many times the bytes its files hold (intermediate concatenations, then the copies
#: it keeps, and float16/bfloat16 values widened to float32).
CONSOLIDATION_FACTOR = 4
_CONSOLIDATION_SLACK = 1 << 20  # scalars, step counts and other small copies of an empty or tiny checkpoint

_UNSAFE_HINT = (
    "phalanx loads checkpoints with torch.load(weights_only=True) only, because unpickling arbitrary objects can run"
    " any code the file's author chose. A phalanx checkpoint holds only tensors and plain Python values. If you"
    " wrote this file and trust it, load it yourself with torch.load(path, weights_only=False), keep the tensors and"
    " plain values, and save that again."
)

_KINDS = [
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
]


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse_kind(path: str | os.PathLike, mode: int, source: str) -> CheckpointError:
    return CheckpointError(
        f"Refusing to read {source}: {os.fspath(path)} is {_kind(mode)}, not a regular file; a checkpoint file is a"
        " regular file (reading anything else could wait forever or never end)."
    )


def open_checkpoint_file(path: str | os.PathLike, source: str | None = None) -> BinaryIO:
    """``path`` opened for reading in binary mode, refused (``CheckpointError``) unless it is a regular file.

    Raises ``FileNotFoundError`` when nothing is there. The file is opened without blocking, so a FIFO planted after
    the first look is refused too instead of waiting for a writer.
    """
    source = source or os.fspath(path)
    mode = os.stat(path).st_mode  # follows links: what would be read
    if not stat.S_ISREG(mode):
        raise _refuse_kind(path, mode, source)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse_kind(path, mode, source)
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def reopenable_path(stream: Any) -> str | None:
    """A path that opens the very file ``stream`` has open (Linux's ``/proc/self/fd/N``), or None where there is none.

    torch maps a file only by its path, and reads a path faster than a Python stream; this path leads to the file
    that was opened and checked, even if the checkpoint's name is replaced or made a link meanwhile.
    """
    try:
        descriptor = stream.fileno()
        opened = os.fstat(descriptor)
    except (AttributeError, OSError, ValueError):  # not a file (BytesIO, a URL's stream), or closed
        return None
    candidate = f"/proc/self/fd/{descriptor}"
    try:
        if stat.S_ISREG(opened.st_mode) and os.path.samestat(os.stat(candidate), opened):
            return candidate
    except OSError:  # no /proc (macOS, Windows): the stream itself is read
        pass
    return None


def is_regular_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` (links followed) is a regular file; never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------------- the archive, before torch reads it
def _size(stream: Any) -> int:
    position = stream.tell()
    end = stream.seek(0, io.SEEK_END)
    stream.seek(position)
    return end


def check_archive(stream: Any, source: str) -> None:
    """Refuse what is not a torch.save zip archive whose entries all fit, uncompressed, in the file.

    Only the archive's directory is read (zip keeps it at the end); a file that is not an archive is scanned for at
    most ``MESSAGE_SCAN_BYTES`` to name the globals a hostile pickle references.
    """
    size = _size(stream)
    stream.seek(0)
    starts_as_archive = stream.read(4) == b"PK\x03\x04"  # torch reads an archive only from the file's first byte
    stream.seek(0)
    try:
        archive = zipfile.ZipFile(stream) if starts_as_archive and zipfile.is_zipfile(stream) else None
        entries = archive.infolist() if archive is not None else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        entries = None
    stream.seek(0)
    if entries is None:
        names = disallowed_globals_of_pickle(_bounded_read(stream, MESSAGE_SCAN_BYTES))
        stream.seek(0)
        if names:
            raise UnsafeCheckpointError(
                f"Refusing to load {source}: it references {', '.join(names)}, which is not a tensor or plain value"
                f" and loads only with weights_only=False, i.e. by running arbitrary code. {_UNSAFE_HINT}"
            )
        raise CheckpointError(
            f"{source} is not a checkpoint torch can read (not the zip archive torch.save writes: truncated, damaged,"
            " or torch's legacy format, which phalanx does not read because it allocates the sizes it claims)."
        )
    compressed = [entry.filename for entry in entries if entry.compress_type != zipfile.ZIP_STORED]
    claimed = sum(entry.file_size for entry in entries)
    if compressed or claimed > size:
        detail = (
            f"its entries {compressed[:3]} are compressed (torch.save stores them as they are)"
            if compressed
            else f"its entries claim {claimed} bytes but the file holds {size}"
        )
        raise CheckpointError(
            f"Refusing to load {source}: {detail}; reading it could allocate more memory than the file holds."
        )
    if _QUANTIZED in _pickle_of(archive, entries):
        raise CheckpointError(
            f"Refusing to load {source}: it holds a quantized tensor ({_QUANTIZED}), which torch's reader allocates"
            " at the size the file claims before checking it against the bytes stored; phalanx does not read"
            " quantized tensors from checkpoints. Save tensor.dequantize() instead."
        )
    stream.seek(0)


_QUANTIZED = "torch._utils._rebuild_qtensor"


def referenced_globals(data: bytes) -> list[str]:
    """The ``module.name`` globals a pickle refers to, found by reading its opcodes (nothing is unpickled)."""
    import pickletools

    found: list[str] = []
    memo: dict[Any, Any] = {}
    pushed: list[Any] = []  # the strings pushed (directly or from the memo), in order: STACK_GLOBAL takes the last two
    last: Any = None  # what the previous opcode pushed, if it was a string
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[arg if name != "MEMOIZE" else len(memo)] = last
                continue
            last = None
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(pushed) >= 2:
                found.append(f"{pushed[-2]}.{pushed[-1]}")
            elif "UNICODE" in name or "STRING" in name or name in ("GET", "BINGET", "LONG_BINGET"):
                last = arg if "GET" not in name else memo.get(arg)
                pushed.append(last)
            elif name == "STOP":
                break
    except Exception:  # damaged bytes: what was found before them
        pass
    return list(dict.fromkeys(found))


def check_mapped_records(stream: Any, source: str) -> None:
    """Refuse an archive whose pickle claims a storage of another size than the record that stores it.

    torch checks this itself when it copies a record, not when it maps the file (``mmap=True``): a storage that
    claims more than its record would then show the bytes of the records after it. Only data.pkl is read, by torch's
    weights-only unpickler with storages that allocate nothing; a pickle it cannot read is left to the load to refuse.
    """
    entries: dict[str, int] = {}
    pickle_name: str | None = None
    stream.seek(0)
    try:
        with zipfile.ZipFile(stream) as archive:
            entries = {info.filename: info.file_size for info in archive.infolist()}
            pickle_name = next((name for name in entries if name.endswith("data.pkl")), None)
            pickled = archive.read(pickle_name) if pickle_name is not None else b""
        claims = _claimed_storages(pickled)
    except Exception:  # the load itself names what is wrong with such a file
        claims = {}
    finally:
        stream.seek(0)
    prefix = pickle_name[: -len("data.pkl")] if pickle_name else ""
    for key, claimed in claims.items():
        stored = entries.get(f"{prefix}data/{key}")
        if stored != claimed:
            held = "no record" if stored is None else f"a record of {stored} bytes"
            raise CheckpointError(
                f"Refusing to load {source}: its storage {key!r} claims {claimed} bytes but the archive holds {held}"
                " for it; mapping it would show the bytes of other records as this tensor's."
            )


def _claimed_storages(pickled: bytes) -> dict[str, int]:
    """The bytes each storage of the pickle claims, by record key, found without reading or allocating any."""
    from torch import _weights_only_unpickler

    claims: dict[str, int] = {}

    def persistent_load(saved_id: Any) -> Any:
        _, storage_type, key, _, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        claims[str(key)] = max(claims.get(str(key), 0), nbytes)
        storage = torch.UntypedStorage(nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    unpickler.load()
    return claims


def _pickle_of(archive: Any, entries: list[zipfile.ZipInfo]) -> list[str]:
    """The globals the archive's data.pkl names, looked for only where its bytes mention a quantized tensor."""
    entry = next((info for info in entries if info.filename.endswith("data.pkl")), None)
    pickled = archive.read(entry) if entry is not None else b""  # no larger than the file (checked above)
    return referenced_globals(pickled) if b"_rebuild_qtensor" in pickled else []


def _bounded_read(stream: Any, limit: int) -> bytes:
    try:
        return stream.read(limit)
    except OSError:
        return b""


def disallowed_globals_of_pickle(data: bytes) -> list[str]:
    """The globals the pickle ``data`` names that torch's weights-only reader refuses (for messages only)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

        allowed = set(_get_allowed_globals()) | set(_get_user_allowed_globals())
    except Exception:  # only a better message is at stake
        return []
    return [name for name in referenced_globals(data) if name not in allowed]


def archive_pickle(stream: Any, limit: int = MESSAGE_SCAN_BYTES * 64) -> bytes:
    """The data.pkl of the torch.save archive ``stream`` (empty if larger than ``limit`` or unreadable)."""
    try:
        stream.seek(0)
        with zipfile.ZipFile(stream) as archive:
            entry = next((info for info in archive.infolist() if info.filename.endswith("data.pkl")), None)
            if entry is None or entry.file_size > limit:
                return b""
            return archive.read(entry)
    except Exception:  # only a better message is at stake
        return b""


# ---------------------------------------------------------------------------- the tensors torch built
def tensors_in(value: Any) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor in the nested dicts, lists and tuples of ``value`` (cycles visited once)."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append((where, item))
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((f"{where}[{key!r}]", child) for key, child in pairs)
        elif hasattr(item, "__dict__") and id(item) not in seen:  # an allow-listed record (DeepSpeed's stand-ins)
            seen.add(id(item))
            stack.extend((f"{where}.{key}", child) for key, child in vars(item).items())
    return found


def check_tensors(value: Any, source: str) -> None:
    """Refuse a tensor in ``value`` that claims more elements than its storage holds (an expanded or overlapping view).

    torch.save writes a tensor's storage, not its elements: an honest tensor is its storage or a part of it. A view
    with stride 0 (``expand``) or overlapping strides claims elements no byte of the file backs; the first copy,
    concatenation or ``contiguous`` would allocate them all.
    """
    for where, tensor in tensors_in(value):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            continue
        numel = tensor.numel()
        if numel == 0:
            continue
        itemsize = tensor.element_size()
        stored = tensor.untyped_storage().nbytes()
        span = tensor.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride())) + 1
        if numel * itemsize > stored or span * itemsize > stored:
            raise CheckpointError(
                f"Refusing to load {source}: the tensor at checkpoint{where} claims {numel} elements of"
                f" {tensor.dtype} ({numel * itemsize} bytes) but its storage in the file holds {stored} bytes (a view"
                " with zero or overlapping strides, e.g. made by expand()). A checkpoint's tensors must be backed by"
                " their bytes: save tensor.contiguous() or tensor.clone() instead."
            )


def stored_bytes(value: Any) -> int:
    """The bytes of the distinct storages behind the tensors of ``value`` (what the files read actually held)."""
    storages: dict[tuple[str, int], int] = {}
    for _, tensor in tensors_in(value):
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class AllocationBudget:
    """What a consolidation may allocate: ``CONSOLIDATION_FACTOR`` times the bytes of the files it read."""

    def __init__(self, inputs: Any, source: str) -> None:
        self.source = source
        self.stored = stored_bytes(inputs)
        self.limit = CONSOLIDATION_FACTOR * self.stored + _CONSOLIDATION_SLACK
        self.used = 0

    def take(self, numel: int, dtype: torch.dtype) -> None:
        """Count ``numel`` elements of ``dtype`` about to be allocated; refuse past the limit."""
        self.used += numel * dtype.itemsize
        if self.used > self.limit:
            raise CheckpointError(
                f"Refusing to consolidate {self.source}: it would allocate more than {self.limit} bytes"
                f" ({CONSOLIDATION_FACTOR} times the {self.stored} bytes its files hold); its files claim tensors"
                " their bytes do not back (the same bytes used for many tensors)."
            )


_BUDGET: contextvars.ContextVar[AllocationBudget | None] = contextvars.ContextVar("phalanx_budget", default=None)


@contextmanager
def allocation_budget(inputs: Any, source: str) -> Iterator[AllocationBudget]:
    """While active, ``counted_cat``/``counted_clone``/``counted_float`` count against a budget set by ``inputs``."""
    budget = AllocationBudget(inputs, source)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def _take(numel: int, dtype: torch.dtype) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.take(numel, dtype)


def counted_flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.reshape(-1)``, counted against the active budget when that copies."""
    if not tensor.is_contiguous():
        _take(tensor.numel(), tensor.dtype)
    return tensor.reshape(-1)


def counted_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of the flattened ``tensors``, counted against the active budget."""
    _take(sum(t.numel() for t in tensors), tensors[0].dtype if tensors else torch.float32)
    return torch.cat([counted_flat(t) for t in tensors])


def counted_clone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.clone()``, counted against the active budget."""
    _take(tensor.numel(), tensor.dtype)
    return tensor.clone()


def counted_float(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 when it is float16/bfloat16 (a new tensor, counted), else ``tensor`` itself."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        _take(tensor.numel(), torch.float32)
        return tensor.float()
    return tensor


__all__ = [
    "AllocationBudget",
    "allocation_budget",
    "check_archive",
    "check_mapped_records",
    "check_tensors",
    "counted_cat",
    "counted_clone",
    "counted_flat",
    "counted_float",
    "is_regular_file",
    "open_checkpoint_file",
    "reopenable_path",
    "stored_bytes",
]
