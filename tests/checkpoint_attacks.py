"""Hostile pickles and damaged files for the checkpoint attack tests (each payload would create a marker file if run).

A payload is a run of pickle opcodes that pushes one value; run by a naive unpickler it creates ``marker``. It is
spliced into an otherwise valid pickle (DCP's metadata, a checkpoint dictionary, a DeepSpeed file) in place of a
sentinel string, or used alone. ``test_every_payload_runs_code_when_unpickled_naively`` proves each one is live.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from phalanx.utilities.exceptions import CheckpointError

SENTINEL = "__PHALANX_PAYLOAD__"
DCP = "torch.distributed.checkpoint.metadata"


# ---------------------------------------------------------------------------- opcodes
def text(value: str, legacy: bool = False) -> bytes:
    data = value.encode()
    if legacy or len(data) >= 256:
        return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE (protocol 1+)
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE (protocol 4)


def stack_global(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def old_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(function: bytes, *arguments: bytes) -> bytes:
    return function + b"(" + b"".join(arguments) + b"tR"


def payloads(marker: Path, legacy: bool = False) -> dict[str, tuple[bytes, str]]:
    """name -> (opcodes pushing one value, the global a safe reader must name when it refuses).

    ``legacy`` writes strings and globals the way torch.save's protocol 2 does (BINUNICODE, GLOBAL), so that torch's
    weights-only reader meets the payload's globals rather than stopping at a newer opcode; the payloads that are
    about protocol-4 opcodes (STACK_GLOBAL, INST, OBJ, ...) keep them.
    """
    s = lambda value: text(value, legacy)  # noqa: E731
    g = old_global if legacy else stack_global
    command, path = f"touch {marker}", str(marker)
    slot = struct.pack("<I", 90000)

    def via_getattr(obtain_os: bytes) -> bytes:
        # getattr(<os module>, 'system')(command): the os module is obtained first (the global a reader must refuse),
        # kept in the memo, then fetched as getattr's argument.
        return (
            obtain_os + b"r" + slot + b"0" + call(call(g("builtins", "getattr"), b"j" + slot, s("system")), s(command))
        )

    def strings(*values: str) -> bytes:
        return b"](" + b"".join(s(v) for v in values) + b"e"

    os_system = call(g("os", "system"), s(command))
    return {
        "dotted os.system through DCP's metadata module": (call(g(DCP, "os.system"), s(command)), f"{DCP}.os.system"),
        "dotted os.system through pathlib": (call(g("pathlib", "os.system"), s(command)), "pathlib.os.system"),
        "dotted os.system through DCP's filesystem module": (
            call(g("torch.distributed.checkpoint.filesystem", "os.system"), s(command)),
            "filesystem.os.system",
        ),
        "dotted os.system through torch": (call(g("torch", "os.system"), s(command)), "torch.os.system"),
        "module globals of a DCP dataclass": (
            via_getattr(call(g(DCP, "Metadata.__init__.__globals__.get"), s("os"))),
            "Metadata.__init__.__globals__.get",
        ),
        "collections' sys.modules": (
            via_getattr(call(g("collections", "_sys.modules.get"), s("os"))),
            "collections._sys.modules.get",
        ),
        "builtins.eval": (call(g("builtins", "eval"), s(f"open({path!r}, 'w').close()")), "builtins.eval"),
        "builtins.exec": (call(g("builtins", "exec"), s(f"open({path!r}, 'w').close()")), "builtins.exec"),
        "builtins.open": (call(g("builtins", "open"), s(path), s("w")), "builtins.open"),
        "builtins.getattr on an allowed PosixPath": (
            call(call(g("builtins", "getattr"), call(g("pathlib", "PosixPath"), s(path)), s("touch")), b""),
            "builtins.getattr",
        ),
        "posix.system": (call(g("posix", "system"), s(command)), "posix.system"),
        "os.system by the GLOBAL opcode": (call(old_global("os", "system"), s(command)), "os.system"),
        "subprocess.Popen": (call(g("subprocess", "Popen"), strings("touch", path)), "subprocess.Popen"),
        "a torch name that is not a dtype": (call(g("torch", "save"), b"}", s(path)), "torch.save"),
        "a dtype-like dotted torch name": (
            g("torch", "float32.__reduce_ex__") + b"0" + os_system,
            "torch.float32.__reduce_ex__",
        ),
        "torch.serialization internals": (
            call(g("torch.serialization", "save"), b"}", s(path)),
            "torch.serialization.save",
        ),
        "globals of an allowed torch.serialization helper": (
            via_getattr(call(g("torch.serialization", "_get_layout.__globals__.get"), s("os"))),
            "_get_layout.__globals__.get",
        ),
        "INST opcode": (b"(" + s(command) + b"ios\nsystem\n", "os.system"),
        "OBJ opcode": (b"(" + stack_global("os", "system") + s(command) + b"o", "os.system"),
        "NEWOBJ of an allowed class, BUILD installing __setstate__": (
            g(DCP, "StorageMeta")
            + b")\x81"
            + b"N}"
            + s("__setstate__")
            + g("os", "system")
            + b"s\x86b"
            + s(command)
            + b"b",
            f"{DCP}.StorageMeta" if legacy else "os.system",  # torch's reader allows neither; DCP's allows the class
        ),
        "STACK_GLOBAL with names from the memo": (
            s("os")
            + b"r"
            + struct.pack("<I", 90001)
            + b"0"
            + s("system")
            + b"r"
            + struct.pack("<I", 90002)
            + b"0"
            + b"j"
            + struct.pack("<I", 90001)
            + b"j"
            + struct.pack("<I", 90002)
            + b"\x93("
            + s(command)
            + b"tR",
            "os.system",
        ),
        "STACK_GLOBAL with computed names": (
            call(
                call(g("builtins", "str.join"), s(""), strings("o", "s"))
                + call(g("builtins", "str.join"), s(""), strings("sys", "tem"))
                + b"\x93",
                s(command),
            ),
            "builtins.str.join",
        ),
    }


# ---------------------------------------------------------------------------- splicing into valid pickles
def splice(valid: Any, ops: bytes, legacy: bool = False) -> bytes:
    """``valid`` pickled, the sentinel string replaced by ``ops``; the header says protocol 4 (under which pickle
    follows dotted names). ``legacy``: the opcodes of protocol 2, as torch.save writes them.

    The frames are left out (they are optional) so that the payload's length does not matter.
    """
    import pickletools

    if legacy:
        data = pickle.dumps(valid, protocol=2)
        encoded = SENTINEL.encode()
        sentinel = b"X" + struct.pack("<I", len(encoded)) + encoded
        assert data.count(sentinel) == 1, "the sentinel must appear once"
        return b"\x80\x04" + data[2:].replace(sentinel, ops)
    data = pickle.dumps(valid, protocol=4)
    kept, previous = [], 0
    for opcode, _, position in pickletools.genops(data):
        if opcode.name == "FRAME":
            kept.append(data[previous:position])
            previous = position + 9
    kept.append(data[previous:])
    unframed = b"".join(kept)
    encoded = SENTINEL.encode()
    sentinel = b"\x8c" + bytes([len(encoded)]) + encoded
    assert unframed.count(sentinel) == 1, "the sentinel must appear once"
    return unframed.replace(sentinel, ops)


def bare(ops: bytes) -> bytes:
    return b"\x80\x04" + ops + b"."


def torch_file(pickled: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is ``pickled`` (which must hold no tensors)."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            archive.writestr(
                info.filename, pickled if info.filename.endswith("data.pkl") else source.read(info.filename)
            )
    return out.getvalue()


# ---------------------------------------------------------------------------- watching which files are opened
class OpenedFiles:
    """Records every path this process opens while active (audit hooks cannot be removed: one for the session)."""

    active: list[str] | None = None
    _installed = False

    def __enter__(self) -> list[str]:
        if not OpenedFiles._installed:
            sys.addaudithook(_record_open)
            OpenedFiles._installed = True
        OpenedFiles.active = []
        return OpenedFiles.active

    def __exit__(self, *exc: Any) -> None:
        OpenedFiles.active = None


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and OpenedFiles.active is not None and isinstance(args[0], (str, bytes, Path)):
        OpenedFiles.active.append(
            str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode(errors="replace")).resolve())
        )


# ---------------------------------------------------------------------------- damage
def damage(path: Path, kind: str) -> None:
    """Break ``path`` the way a crash, a full disk or a bad copy would."""
    data = path.read_bytes()
    if kind == "missing":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "half":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random bytes":
        path.write_bytes(
            torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
            .numpy()
            .tobytes()
        )
    elif kind == "wrong magic":
        path.write_bytes(bytes([data[0] ^ 0xFF, data[1] ^ 0xFF]) + data[2:])
    else:
        raise ValueError(kind)


DAMAGE_KINDS = ["missing", "empty", "half", "random bytes", "wrong magic"]


class CliError(CheckpointError):
    """What ``phalanx checkpoint consolidate`` printed when it refused (exit status 2, no output file)."""


def consolidate_through_cli(path: Path, tmp_path: Path) -> None:
    """Run ``phalanx checkpoint consolidate PATH OUT`` in this process; raise CliError with its message on refusal."""
    import contextlib

    from phalanx.cli import main

    out, err = tmp_path / "consolidated.ckpt", io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["checkpoint", "consolidate", str(path), str(out)])
    if status != 0:
        assert status == 2 and not out.exists()
        raise CliError(err.getvalue())
