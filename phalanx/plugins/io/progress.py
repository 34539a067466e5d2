"""How far the training in a checkpoint got, and with which hyper-parameters, read without loading its tensors.

``ckpt_path="auto"`` ranks the checkpoints it finds by what they record (``global_step``, then the fit loop's batch
count, epoch and phase), never by file times, which a copy or a clock can set to anything. A single file's pickle
(``data.pkl``, after ``check_archive`` looked at the archive's directory) is read by torch's weights-only unpickler
with storages that hold no bytes: no tensor record is read (a pickle larger than ``MAX_PICKLE_BYTES`` is not read at
all: that checkpoint ranks as recording no progress). A checkpoint directory's state file
(``Format.state_file``: ``phalanx_meta.pt``, ``phalanx_deepspeed_state.pt``, xla_fsdp's meta file) is read the same
way, once the directory has its ``.complete`` marker.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import _weights_only_unpickler  # torch's reader of weights_only=True, used here on data.pkl alone

from phalanx.plugins.io.bounded_reads import (
    _UNSAFE_HINT,
    check_archive,
    disallowed_globals_of_pickle,
    open_checkpoint_file,
)
from phalanx.plugins.io.checkpoint_files import entry_inside
from phalanx.plugins.io.checks import LOOP_PHASES, check_count, check_dict
from phalanx.plugins.io.formats import detect_directory, not_a_checkpoint
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

#: A checkpoint whose pickle (everything but the tensors' bytes) is larger is ranked as recording no progress, rather
#: than unpickled only to rank it (it still loads, if chosen).
MAX_PICKLE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a checkpoint records about the training it holds (-1 where it records nothing)."""

    global_step: int
    epoch: int
    total_batches: int
    phase: str
    #: The module's hyper-parameters as saved (None when the checkpoint holds none).
    hyper_parameters: dict[str, Any] | None

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Orders checkpoints by how far their training got: steps, then batches, epochs and the epoch's phase."""
        phase = LOOP_PHASES.index(self.phase) if self.phase in LOOP_PHASES else -1
        return (self.global_step, self.total_batches, self.epoch, phase)


def recorded_progress(path: str | os.PathLike) -> Progress:
    """The progress the complete checkpoint at the local ``path`` (a file or a directory) records.

    Raises ``CheckpointError`` (``UnsafeCheckpointError`` for a pickle that names code) naming the file when it
    cannot be read, as loading it would.
    """
    path = Path(path)
    if path.is_dir():
        checkpoint_layout(path)  # refuses a directory without its .complete marker
        entry = detect_directory(path)
        if entry is None or entry.state_file is None:
            raise not_a_checkpoint(path)
        state_file = entry_inside(path, entry.state_file, root=path, what=f"the state file {entry.state_file!r}")
        return _progress(_read_small_entries(state_file, str(path / entry.state_file)), str(path))
    return _progress(_read_small_entries(path, str(path)), str(path))


def _read_small_entries(path: Path, source: str) -> Any:
    """The object pickled in the torch.save archive at ``path``, its tensors empty (on the meta device); None when its
    pickle is larger than ``MAX_PICKLE_BYTES``."""
    with open_checkpoint_file(path, source) as handle:
        check_archive(handle, source)  # reads the archive's directory only; every entry fits in the file
        with zipfile.ZipFile(handle) as archive:
            entry = next((info for info in archive.infolist() if info.filename.endswith("data.pkl")), None)
            if entry is None:
                raise CheckpointError(f"{source} has no data.pkl: it is not an archive torch.save wrote.")
            if entry.file_size > MAX_PICKLE_BYTES:
                return None  # a state too big to read only for ranking: its progress is unknown
            pickled = archive.read(entry)

    def persistent_load(saved_id: Any) -> Any:
        _, storage_type, _, _, numel = saved_id  # the tensor's record is never read: a storage without bytes
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        storage = torch.UntypedStorage(int(numel) * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        return unpickler.load()
    except pickle.UnpicklingError as error:
        names = disallowed_globals_of_pickle(pickled)
        if names:
            raise UnsafeCheckpointError(
                f"Refusing to load {source}: it references {', '.join(names)}, which is not a tensor or plain value"
                f" and loads only with weights_only=False, i.e. by running arbitrary code. {_UNSAFE_HINT}"
            ) from None
        raise CheckpointError(f"{source} is not a checkpoint torch can read: {error}") from None
    except Exception as error:  # bytes torch.save did not write fail in many ways
        raise CheckpointError(f"{source} is not a checkpoint torch can read: {type(error).__name__}: {error}") from None


def _progress(state: Any, source: str) -> Progress:
    if state is None:
        return Progress(-1, -1, -1, "", None)
    check_dict(source, "", state)
    loops = state.get("loops")
    loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    loop = loop if isinstance(loop, dict) else {}
    counts = {}
    for key in ("global_step", "epoch", "total_batches"):
        entry = f"[{key!r}]" if key in state else f"['loops']['fit_loop'][{key!r}]"
        value = state[key] if key in state else loop.get(key)
        check_count(source, entry, value, required=False)
        counts[key] = -1 if value is None else int(value)
    phase = loop.get("phase")
    hparams = state.get("hyper_parameters")
    return Progress(
        global_step=counts["global_step"],
        epoch=counts["epoch"],
        total_batches=counts["total_batches"],
        phase=phase if isinstance(phase, str) else "",
        hyper_parameters=hparams if isinstance(hparams, dict) else None,
    )


__all__ = ["MAX_PICKLE_BYTES", "Progress", "recorded_progress"]
