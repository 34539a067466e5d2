"""Which checkpoint ``ckpt_path="auto"`` resumes from (and ``"last"`` when its callback does not know its file).

Only the folders this run writes to are searched, each one level deep (never below): every ModelCheckpoint's folder
and the preemption folder (``trainer.checkpoint_dir``). A checkpoint folder inside a logger's ``version_N`` folder
(the default, ``logs/version_N/checkpoints``) brings the same folder of that logger's other numbered versions: the
earlier runs of this experiment, which a requeued job continues. A checkpoint found there whose hyper-parameters
differ from the module's is passed over as another experiment's; in the run's own folders it is resumed with a warning.

An entry counts if it is a complete checkpoint (``is_complete_checkpoint``) and, if it is a symbolic link, only when it
names a checkpoint beside it, as ``save_last="link"`` makes (a link planted to lead anywhere else is passed over).
The one chosen records the furthest progress (``phalanx.plugins.io.progress``: steps, then batches, epochs, the
epoch's phase), read without loading any tensor; file times only break ties between checkpoints that record the same
progress. A complete checkpoint whose progress cannot be read stops the resume with its error, as loading it would:
it is never silently passed over.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from phalanx.plugins.io.bounded_reads import is_regular_file, open_checkpoint_file
from phalanx.plugins.io.directory import COMPLETE_MARKER, is_own_link, is_retired_copy
from phalanx.plugins.io.progress import Progress, recorded_progress
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.hparams import is_plain

_VERSION = re.compile(r"^version_[0-9]+$")


def is_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a finished checkpoint: a whole torch file, or a directory with its completion marker.

    A previous checkpoint moved aside by a save that replaces it (see ``phalanx.plugins.io.directory``) counts: a
    kill between that save's two renames leaves it as the newest complete checkpoint of its name. Anything but a
    directory or a regular file (a FIFO would block the look inside it) is not a checkpoint.
    """
    if is_retired_copy(path):
        return path.is_dir() and (path / COMPLETE_MARKER).exists()
    if path.name.startswith(".") or path.name.endswith(".tmp"):
        return False  # an atomic write still in progress (or abandoned by a killed process)
    if path.is_dir():
        return (path / COMPLETE_MARKER).exists()
    if not is_regular_file(path):
        return False
    try:
        # torch.save writes a zip archive whose directory sits at the end: a truncated file has none.
        with open_checkpoint_file(path) as handle, zipfile.ZipFile(handle) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile, CheckpointError):
        return False


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint chosen (None: none), what it records, why it won, and what was passed over (phrases for the
    line that reports it)."""

    path: str | None
    progress: Progress | None
    reason: str
    passed_over: str = ""


def checkpoints_in(folder: Path, name_prefix: str = "") -> list[Path]:
    """The complete ``{name_prefix}*.ckpt`` checkpoints (and retired copies) directly in ``folder``, links resolved.

    A symbolic link counts only as phalanx makes them: naming a checkpoint beside it (``is_own_link``).
    """
    try:
        with os.scandir(folder) as listing:
            names = sorted(entry.name for entry in listing)
    except OSError:
        return []
    found: dict[str, Path] = {}
    for name in names:
        path = folder / name
        if is_retired_copy(path):
            if not name[1:].startswith(name_prefix):
                continue
        elif not (name.startswith(name_prefix) and name.endswith(".ckpt")):
            continue
        if path.is_symlink():
            if not is_own_link(path):
                continue  # planted, or switched to lead elsewhere: never followed
            path = folder / os.readlink(path)
        if is_complete_checkpoint(path):
            found.setdefault(os.path.realpath(path), Path(os.path.realpath(path)))
    return list(found.values())


def choose_checkpoint(
    folders: list[Path],
    *,
    name_prefix: str = "",
    experiment: frozenset[str] = frozenset(),
    hparams: dict[str, Any] | None = None,
) -> Choice:
    """The complete checkpoint in ``folders`` that records the furthest progress (see the module docstring).

    ``experiment``: the folders (real paths) of the experiment's other runs, where a checkpoint whose
    ``hyper_parameters`` differ from ``hparams`` (the module's plain ones, if it has any) is passed over.
    """
    ranked: list[tuple[tuple[Any, ...], str, Progress]] = []
    passed_over: list[str] = []
    for folder in folders:
        foreign_allowed = os.path.realpath(folder) not in experiment
        for path in checkpoints_in(folder, name_prefix):
            progress = recorded_progress(path)
            if not foreign_allowed and differing_hparams(progress, hparams):
                passed_over.append(str(path))
                continue
            ranked.append(((progress.key, _mtime(path), str(path)), str(path), progress))
    skipped = ""
    if passed_over:
        skipped = (
            f"passed over {len(passed_over)} checkpoint(s) of earlier runs saved with other hyper-parameters than the"
            f" module's, e.g. {passed_over[0]}"
        )
    if not ranked:
        return Choice(None, None, "", skipped)
    ranked.sort()
    _, path, progress = ranked[-1]
    ties = sum(1 for entry in ranked if entry[2].key == progress.key) - 1
    reason = f"the furthest recorded progress of the {len(ranked)} complete checkpoint(s) found"
    if len(ranked) == 1:
        reason = "the only complete checkpoint found"
    if ties:
        reason += f" (the most recently written of {ties + 1} that record the same progress)"
    return Choice(path, progress, reason, skipped)


def differing_hparams(progress: Progress, hparams: dict[str, Any] | None) -> list[str]:
    """The names of the hyper-parameters the checkpoint saved with other values than ``hparams`` (the module's)."""
    if not hparams or progress.hyper_parameters is None:
        return []
    saved = progress.hyper_parameters
    return sorted(key for key in {*saved, *hparams} if saved.get(key, _MISSING) != hparams.get(key, _MISSING))


_MISSING = object()


def module_hparams(module: Any) -> dict[str, Any] | None:
    """The module's hyper-parameters that a checkpoint would record (its plain ones), or None without any."""
    hparams = getattr(module, "hparams", None)
    if not hparams:
        return None
    return {key: value for key, value in dict(hparams).items() if is_plain(value)}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def experiment_folders(folder: Path) -> list[Path]:
    """For ``.../version_N/NAME`` (a logger's numbered version folder), ``.../version_M/NAME`` of every other
    numbered version there (real folders, not links); none for any other folder."""
    version = folder.parent
    if not _VERSION.match(version.name):
        return []
    try:
        with os.scandir(version.parent) as listing:
            siblings = sorted(entry.name for entry in listing if _VERSION.match(entry.name))
    except OSError:
        return []
    found = []
    for name in siblings:
        candidate = version.parent / name / folder.name
        if name != version.name and not (version.parent / name).is_symlink() and not candidate.is_symlink():
            if candidate.is_dir():
                found.append(candidate)
    return found


def newest_complete_checkpoint(directories: list[Path], *, name_prefix: str = "") -> str | None:
    """The path of ``choose_checkpoint``'s choice in ``directories`` (the furthest in training), or None."""
    return choose_checkpoint(directories, name_prefix=name_prefix).path


__all__ = [
    "Choice",
    "checkpoints_in",
    "choose_checkpoint",
    "differing_hparams",
    "experiment_folders",
    "is_complete_checkpoint",
    "module_hparams",
    "newest_complete_checkpoint",
]
