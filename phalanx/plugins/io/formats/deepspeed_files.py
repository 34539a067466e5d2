"""Reading the files of a DeepSpeed checkpoint directory without running code from them or leaving the directory.

Two readers share ``load_deepspeed_file`` (``torch.load(weights_only=True)``, the path checked to lie inside the
checkpoint, an allow-list of DeepSpeed's record types active only during the read):

- consolidation maps DeepSpeed's record types to inert stand-ins and never imports deepspeed;
- resuming (``safe_engine_reads``) stands in for the engine's checkpoint engine while ``engine.load_checkpoint``
  runs, so DeepSpeed's own reads of its files go through the same reader, building DeepSpeed's real record objects
  (loss scalers, ZeRO enums, fragment addresses: classes that only hold values) and nothing else. The reads DeepSpeed
  makes without its checkpoint engine (universal checkpoints, MoE expert files) cannot be made safe this way:
  ``refuse_unsafe_engine_reads`` refuses them.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from phalanx.plugins.io.bounded_reads import check_tensors, is_regular_file, open_checkpoint_file
from phalanx.plugins.io.checkpoint_files import entry_inside, path_inside, tree_inside
from phalanx.plugins.io.serialization import load_bytes
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError


def tag_directory(directory: Path, tag: Any = None) -> tuple[str, Path]:
    """The tag and the directory DeepSpeed's files are in: ``tag`` (from the state file) or the one ``latest`` names.

    Refused unless the tag is a plain name inside ``directory`` and nothing under it leads outside ``directory``.
    """
    what = "the DeepSpeed tag in the state file"
    if not tag:
        latest = entry_inside(directory, "latest", root=directory, what="DeepSpeed's 'latest' file")
        try:
            with open_checkpoint_file(latest, str(directory / "latest")) as handle:
                tag = handle.read(4096).decode().strip()  # a tag is a short name; a huge 'latest' is not read whole
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(
                f"{directory / 'latest'} cannot be read as DeepSpeed's tag name: {type(error).__name__}: {error}"
            ) from None
        what = "the DeepSpeed tag named by 'latest'"
    folder = entry_inside(directory, tag, root=directory, what=what)
    if not folder.is_dir():
        raise CheckpointError(
            f"DeepSpeed checkpoint files not found: {directory / tag} does not exist (the tag directory named by "
            f"the checkpoint)."
        )
    tree_inside(folder, root=directory, what=f"the tag directory {tag!r}")
    return tag, folder


# ---------------------------------------------------------------------------- reading with inert stand-ins
class _DeepSpeedRecord:
    """Stands in for a DeepSpeed object found in a checkpoint: keeps its constructor arguments and state; no code."""

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> _DeepSpeedRecord:
        record = object.__new__(cls)
        record.args = args
        record.state = None
        return record

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _enum_value(value: Any) -> Any:
    """Stands in for a DeepSpeed enum class called with its value (e.g. ``ZeroStageEnum(3)``): the plain value."""
    if type(value) not in (int, str):
        raise TypeError(f"a DeepSpeed enum value is an int or a str, not a {type(value).__name__}")
    return value


_ALLOWED_DEEPSPEED_GLOBALS: list[Any] = [
    (_DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_enum_value, "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum"),
]


#: ``safe_globals`` changes one process-wide set for as long as it is active: phalanx's own reads take turns.
_GLOBALS_LOCK = threading.Lock()


def load_deepspeed_file(
    path: str | os.PathLike,
    *,
    root: Path,
    allowed_globals: list[Any] | None = None,
    map_location: Any = "cpu",
    read: Callable[[Path, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One of DeepSpeed's files, read with ``weights_only=True`` and ``allowed_globals`` (default: inert stand-ins).

    ``path`` must lie inside ``root`` (the checkpoint directory) after resolving symbolic links. The allow-list is
    active only during this read; another thread's ``torch.load`` in that moment would see it too, which is why the
    default maps DeepSpeed's names to objects that run no code. ``read(file, map_location)`` reads the file (a
    CheckpointIO's ``load_checkpoint``, whose ``torch.load(weights_only=True)`` sees the allow-list); by default
    phalanx reads it here.
    """

    file = path_inside(path, root=root, what="a DeepSpeed checkpoint file")
    try:
        with (
            _GLOBALS_LOCK,
            torch.serialization.safe_globals(
                allowed_globals if allowed_globals is not None else _ALLOWED_DEEPSPEED_GLOBALS
            ),
        ):
            if read is not None:
                if file.exists() and not is_regular_file(file):
                    open_checkpoint_file(file, str(path)).close()  # refuses it, naming what it is
                content = read(file, map_location)
                check_tensors(content, str(path))  # whatever reads it: no tensor claims bytes the file lacks
                return content
            with open_checkpoint_file(file, str(path)) as handle:
                return load_bytes(handle, str(path), map_location=map_location)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint {root} is incomplete.") from None


def load_part(
    path: Path, root: Path, key: str, *, read: Callable[[Path, Any], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One of DeepSpeed's files (inert stand-ins for its records; read by ``read`` if given); it must hold ``key``."""
    content = load_deepspeed_file(path, root=root, read=read)
    if key not in content:
        raise CheckpointError(
            f"{path} is not a DeepSpeed file of the kind its name says: it has no {key!r} entry (damaged, or from"
            " another program)."
        )
    return content


def _optim_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class Files:
    """The files of one tag directory of a DeepSpeed checkpoint.

    The number of ranks is the number of partition files present: a rank a file name claims must be below it, and
    the world size the model states record must equal it, so a name or a number in a file cannot make phalanx look
    for (or list) more files than the directory holds.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        names = os.listdir(directory)
        optim = _ranked(names, r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
        zero3_models = _ranked(names, r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
        _check_ranks(directory, optim, _optim_name)
        self.optim_files = [directory / optim[rank] for rank in sorted(optim)]
        self.zero3 = bool(zero3_models)
        if zero3_models:
            _check_ranks(directory, zero3_models, _model_name)
            self.model_files = [directory / zero3_models[rank] for rank in sorted(zero3_models)]
        elif (directory / "mp_rank_00_model_states.pt").is_file():
            self.model_files = [directory / "mp_rank_00_model_states.pt"]
        else:
            raise CheckpointError(
                f"{directory} holds no DeepSpeed model states file (mp_rank_00_model_states.pt is missing)."
            )

    def check_world_size(self, world_size: Any) -> None:
        """Every rank of the saving run left its optimizer partition (and, under ZeRO-3, its model states)."""
        if type(world_size) is not int or world_size < 1:
            raise CheckpointError(f"{self.model_files[0]} is damaged: its dp_world_size is {world_size!r}.")
        for files, name in ((self.optim_files, _optim_name), (self.model_files if self.zero3 else [], _model_name)):
            if files and len(files) != world_size:
                missing = [name(rank) for rank in range(len(files), min(world_size, len(files) + 3))]
                detail = (
                    f"is missing {', '.join(missing)}{' and more' if world_size > len(files) + 3 else ''} (saved by"
                    f" {world_size} processes, {len(files)} partitions present)"
                    if missing
                    else f"holds {len(files)} partitions where {world_size} processes saved"
                )
                raise CheckpointError(
                    f"{self.directory} {detail}: the DeepSpeed checkpoint is incomplete or mixes files of "
                    f"different checkpoints."
                )


def _model_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _ranked(names: list[str], pattern: str) -> dict[int, str]:
    """rank -> file name, for the names that match ``pattern`` (whose group is the rank)."""
    return {int(m.group(1)): name for name in names if (m := re.fullmatch(pattern, name))}


def _check_ranks(directory: Path, files: dict[int, str], name: Callable[[int], str]) -> None:
    """The ranks of ``files`` are exactly 0 .. len(files) - 1 (so a name cannot claim a rank past the files present)."""
    count = len(files)
    beyond = sorted(rank for rank in files if rank >= count)
    if beyond:
        missing = [name(rank) for rank in range(count) if rank not in files]
        raise CheckpointError(
            f"{directory} is missing {', '.join(missing)} ({files[beyond[0]]} names rank {beyond[0]}, but only"
            f" {count} partition files are present): the DeepSpeed checkpoint is incomplete or mixes files of"
            " different checkpoints."
        )


# ---------------------------------------------------------------------------- resuming through DeepSpeed's engine
def check_tag_files(folder: Path, *, world_size: Any, zero_stage: Any) -> None:
    """Refuse a tag directory that lacks a file DeepSpeed would need (it would otherwise resume without them)."""
    files = Files(folder)
    if world_size is not None:
        files.check_world_size(world_size)
    if isinstance(zero_stage, int) and zero_stage >= 1 and not files.optim_files:
        raise CheckpointError(
            f"{folder} is missing {_optim_name(0)} (and every other optimizer partition): "
            f"the DeepSpeed checkpoint is incomplete."
        )


def deepspeed_record_types() -> list[type]:
    """DeepSpeed's classes its checkpoint files hold: each only holds values (imports deepspeed)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum, OffloadDeviceEnum]


class _SafeReads:
    """An engine's checkpoint engine while it resumes: ``load`` is phalanx's reader, the rest is DeepSpeed's."""

    def __init__(self, inner: Any, root: Path, folder: Path, allowed: list[Any], read: Any = None) -> None:
        self._inner, self._root, self._folder, self._allowed, self._read = inner, root, folder, allowed, read

    def load(self, path: str | os.PathLike, map_location: Any = None) -> Any:
        """Read one of DeepSpeed's files of the tag directory with ``weights_only=True``."""
        path_inside(path, root=self._folder, what="a file DeepSpeed reads to resume")
        return load_deepspeed_file(
            path, root=self._root, allowed_globals=self._allowed, map_location=map_location, read=self._read
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def refuse_unsafe_engine_reads(engine: Any, directory: Path) -> None:
    """Refuse the resumes in which DeepSpeed would unpickle files itself, past its checkpoint engine."""
    reasons = []
    if engine.load_universal_checkpoint():
        reasons.append(
            "the config asks for a universal checkpoint ('checkpoint': {'load_universal': true}), whose files"
            " DeepSpeed reads with torch.load(weights_only=False)"
        )
    if getattr(engine, "has_moe_layers", False):
        reasons.append(
            "the model has mixture-of-experts layers, whose expert files DeepSpeed reads with"
            " torch.load(weights_only=False)"
        )
    if reasons:
        raise UnsafeCheckpointError(
            f"Refusing to resume from {directory}: {'; '.join(reasons)}, "
            f"which runs any code the files' author chose. If you wrote this checkpoint yourself and trust it, "
            "pass DeepSpeedStrategy(allow_unsafe_checkpoint_load=True)."
        )


@contextmanager
def safe_engine_reads(engine: Any, directory: Path, folder: Path, *, io: Any = None) -> Iterator[None]:
    """While active, every file ``engine`` reads through its checkpoint engine is checked by phalanx and read with
    ``weights_only=True`` (through ``io.load_checkpoint`` when a CheckpointIO is given)."""
    original = engine.checkpoint_engine
    read = io.load_checkpoint if io is not None else None
    engine.checkpoint_engine = _SafeReads(original, directory, folder, deepspeed_record_types(), read)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


__all__ = [
    "Files",
    "check_tag_files",
    "deepspeed_record_types",
    "load_deepspeed_file",
    "load_part",
    "refuse_unsafe_engine_reads",
    "safe_engine_reads",
    "tag_directory",
]
