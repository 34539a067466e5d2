"""``ckpt_path="auto"`` (issue 33, items 2, 3 and 17): it looks only where this run writes (its ModelCheckpoint
folders, the preemption folder, the earlier ``version_N`` runs of its logger's experiment), one level deep; it picks
the checkpoint whose recorded progress is furthest, never the newest file time alone, reading no tensor to know it;
it passes over links that do not name a checkpoint beside them; it says what it resumed and why; and rank 0 of the
strategy decides, also where no rank is the global zero (a fault-tolerant replica group other than group 0)."""

from __future__ import annotations

import os
import struct
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from bounded_child import run_bounded
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io.formats.dcp import save_sharded
from phalanx.strategies import SingleDeviceStrategy
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Checkpoint directory")

RUN = Path("run") / "ckpts"  # this run's ModelCheckpoint folder, under default_root_dir
YEAR = 365 * 24 * 3600


def _ckpt(path: Path, step: int, *, epoch: int = 0, batches: int | None = None, phase: str = "batches", **extra: Any):
    """A checkpoint file recording ``step`` (and the fit loop's counters), with a small tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    loop = {"epoch": epoch, "global_step": step, "batches_done": step, "phase": phase}
    loop["total_batches"] = step if batches is None else batches
    checkpoint = {"global_step": step, "epoch": epoch, "state_dict": {"w": torch.zeros(2)}, "loops": {"fit_loop": loop}}
    torch.save({**checkpoint, **extra}, path)
    return path


def _age(path: Path, seconds: float) -> None:
    """Set ``path``'s modification time ``seconds`` from now (negative: in the past, positive: in the future)."""
    moment = time.time() + seconds
    os.utime(path, (moment, moment), follow_symlinks=False)


def _resolve(root: Path, dirpaths: list[Path] | None = None) -> str | None:
    """What ``ckpt_path="auto"`` resolves to for a Trainer in ``root`` with ModelCheckpoints at ``dirpaths``."""
    callbacks = [ModelCheckpoint(dirpath=root / d) for d in (dirpaths if dirpaths is not None else [RUN])]
    trainer = quiet_trainer(default_root_dir=root, enable_checkpointing=bool(callbacks), callbacks=callbacks or None)
    return trainer._checkpoint_connector.resolve_path("auto")


# ---------------------------------------------------------------------------- where "auto" looks
# name -> (the run's ModelCheckpoint folders, plant(root) -> the checkpoint "auto" must choose, or None)
WHERE: dict[str, tuple[list[Path], Callable[[Path], Path | None]]] = {
    "another experiment's folder under default_root_dir": (
        [RUN],
        lambda root: _ckpt(root / "other" / "ckpts" / "epoch=9-step=90.ckpt", 90) and None,
    ),
    "the top of default_root_dir": ([RUN], lambda root: _ckpt(root / "stray.ckpt", 90) and None),
    "a subfolder of the run's folder": ([RUN], lambda root: _ckpt(root / RUN / "old" / "a.ckpt", 90) and None),
    "the run's folder": ([RUN], lambda root: _ckpt(root / RUN / "epoch=0-step=4.ckpt", 4)),
    "the preemption folder (no ModelCheckpoint)": (
        [],
        lambda root: _ckpt(root / "checkpoints" / "preempted-epoch=0-step=4.ckpt", 4),
    ),
    "a second ModelCheckpoint's folder": (
        [RUN, Path("run") / "best"],
        lambda root: _ckpt(root / "run" / "best" / "epoch=0-step=4.ckpt", 4),
    ),
    "an earlier version of the logger's experiment": (
        [Path("logs") / "version_1" / "checkpoints"],
        lambda root: _ckpt(root / "logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt", 4),
    ),
    "the versions of another logger's experiment": (
        [Path("logs") / "version_1" / "checkpoints"],
        lambda root: _ckpt(root / "other_logs" / "version_0" / "checkpoints" / "a.ckpt", 90) and None,
    ),
    "a version folder that is a link to another experiment": (
        [Path("logs") / "version_1" / "checkpoints"],
        lambda root: _linked_version(root),
    ),
}


def _linked_version(root: Path) -> None:
    _ckpt(root / "elsewhere" / "checkpoints" / "a.ckpt", 90)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    (root / "logs" / "version_7").symlink_to(root / "elsewhere")
    return None


@pytest.mark.parametrize("case", list(WHERE))
def test_auto_looks_only_where_this_run_writes(tmp_path, case):
    dirpaths, plant = WHERE[case]
    expected = plant(tmp_path)
    assert _resolve(tmp_path, dirpaths) == (str(expected.resolve()) if expected is not None else None)


class OtherReplicaGroup(SingleDeviceStrategy):
    """Rank 0 of its own processes but not the global zero, as a fault-tolerant replica group other than group 0."""

    @property
    def is_global_zero(self) -> bool:
        return False


@pytest.mark.parametrize("strategy", [SingleDeviceStrategy, OtherReplicaGroup])
@pytest.mark.parametrize("planted", [True, False], ids=["a checkpoint in its folder", "an empty folder"])
def test_auto_is_decided_by_rank_zero_of_the_strategy_with_or_without_a_global_zero(tmp_path, strategy, planted):
    # Every replica group restarted with "auto" after all died: the groups other than 0 search their own folders too.
    expected = _ckpt(tmp_path / RUN / "epoch=0-step=4.ckpt", 4) if planted else None
    callbacks = [ModelCheckpoint(dirpath=tmp_path / RUN)]
    trainer = quiet_trainer(
        default_root_dir=tmp_path, enable_checkpointing=True, callbacks=callbacks, strategy=strategy()
    )
    assert trainer.is_global_zero is (strategy is SingleDeviceStrategy)
    resolved = trainer._checkpoint_connector.resolve_path("auto")
    assert resolved == (str(expected.resolve()) if expected is not None else None)


# ---------------------------------------------------------------------------- which one wins
def _future_mtime(root: Path) -> Path:
    _age(_ckpt(root / RUN / "epoch=0-step=5.ckpt", 5), +YEAR)  # a copy or a clock gave it a future time
    winner = _ckpt(root / RUN / "epoch=1-step=10.ckpt", 10)
    _age(winner, -YEAR)
    return winner


def _more_batches(root: Path) -> Path:  # gradient accumulation: batches without a step
    _age(_ckpt(root / RUN / "b.ckpt", 4, batches=16), +60)
    return _ckpt(root / RUN / "a.ckpt", 4, batches=17)


def _later_epoch(root: Path) -> Path:
    _age(_ckpt(root / RUN / "b.ckpt", 4, epoch=1, batches=8), +60)
    return _ckpt(root / RUN / "a.ckpt", 4, epoch=2, batches=8)


def _later_phase(root: Path) -> Path:
    _age(_ckpt(root / RUN / "b.ckpt", 4, phase="batch_end"), +60)
    return _ckpt(root / RUN / "a.ckpt", 4, phase="ended")


def _same_progress(root: Path) -> Path:
    _age(_ckpt(root / RUN / "b.ckpt", 4), -60)
    return _ckpt(root / RUN / "last.ckpt", 4)  # the same state written later: the file time breaks the tie


def _recorded_versus_none(root: Path) -> Path:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, root / RUN / "weights.ckpt")  # records no progress
    _age(root / RUN / "weights.ckpt", +60)
    return _ckpt(root / RUN / "a.ckpt", 0)


RANKING: dict[str, Callable[[Path], Path]] = {
    "more steps beat a future file time": _future_mtime,
    "more batches at the same step": _more_batches,
    "a later epoch at the same step": _later_epoch,
    "a later phase of the same epoch": _later_phase,
    "the same progress: the later write": _same_progress,
    "recorded progress beats none": _recorded_versus_none,
}


@pytest.mark.parametrize("case", list(RANKING))
def test_auto_picks_the_furthest_recorded_progress(tmp_path, case):
    (tmp_path / RUN).mkdir(parents=True)
    winner = RANKING[case](tmp_path)
    assert _resolve(tmp_path) == str(winner.resolve())


# ---------------------------------------------------------------------------- links in the run's folder
def _link(root: Path, text: Callable[[Path], Path | str]) -> None:
    (root / RUN / "planted.ckpt").symlink_to(text(root))


def _elsewhere(root: Path) -> Path:
    return _ckpt(root / "other" / "epoch=99-step=990.ckpt", 990)  # another experiment, inside default_root_dir


def _subfolder(root: Path) -> Path:
    return _ckpt(root / RUN / "nested" / "epoch=99-step=990.ckpt", 990)


def _directory_outside(root: Path) -> Path:
    save_sharded(
        {"global_step": 990, "state_dict": {"w": torch.ones(2)}},
        root / "other" / "sharded.ckpt",
        is_global_zero=True,
        broadcast=lambda v: v,
        barrier=lambda n: None,
    )
    return root / "other" / "sharded.ckpt"


LINKS: dict[str, tuple[Callable[[Path], Path | str], bool]] = {
    # name -> (the link's target, whether "auto" may follow it)
    "a link to a checkpoint elsewhere under default_root_dir": (_elsewhere, False),
    "a link to a checkpoint in a subfolder of the run's folder": (_subfolder, False),
    "a link to a directory checkpoint outside": (_directory_outside, False),
    "a relative link leading out with '..'": (lambda root: os.path.relpath(_elsewhere(root), root / RUN), False),
    "save_last='link''s link to a checkpoint beside it": (
        lambda root: _ckpt(root / RUN / "epoch=9-step=990.ckpt", 990).name,
        True,
    ),
}


@pytest.mark.parametrize("case", list(LINKS))
def test_auto_follows_only_links_to_a_checkpoint_beside_them(tmp_path, case):
    kept = _ckpt(tmp_path / RUN / "epoch=0-step=1.ckpt", 1)
    target, followed = LINKS[case]
    _link(tmp_path, target)
    chosen = _resolve(tmp_path)
    linked = (tmp_path / RUN / "planted.ckpt").resolve()
    assert chosen == (str(linked) if followed else str(kept.resolve()))


# ---------------------------------------------------------------------------- what it reads, and what stops it
def test_auto_walks_no_deeper_than_the_run_folder(tmp_path):
    kept = _ckpt(tmp_path / RUN / "epoch=0-step=1.ckpt", 1)
    deep = tmp_path / RUN / "nest"
    current = deep
    for _ in range(1500):  # deep enough to exhaust a recursive walk
        current.mkdir()
        current = current / "d"
    try:
        assert _resolve(tmp_path) == str(kept.resolve())
        assert _resolve(tmp_path.parent, [tmp_path.relative_to(tmp_path.parent) / RUN]) == str(kept.resolve())
    finally:
        for _ in range(1500):
            current = current.parent
            current.rmdir() if current.exists() else None


def test_ranking_reads_no_tensor(tmp_path):
    for step in range(3):  # 64 MiB of tensors each
        _ckpt(tmp_path / RUN / f"epoch=0-step={step}.ckpt", step, big=torch.ones(16 << 20))

    def resolve() -> None:
        raise Chosen(str(_resolve(tmp_path)))

    outcome = run_bounded(resolve, headroom=1 << 30)
    assert outcome.error == "Chosen" and outcome.message.endswith("step=2.ckpt"), str(outcome)
    assert outcome.read_bytes < 8 << 20, f"read {outcome.read_bytes} bytes to rank 192 MiB of checkpoints"


class Chosen(Exception):
    """Carries the chosen path out of the child."""


def test_a_checkpoint_too_big_to_rank_counts_as_recording_no_progress(tmp_path, monkeypatch):
    import phalanx.plugins.io.progress as progress

    monkeypatch.setattr(progress, "MAX_PICKLE_BYTES", 4096)
    kept = _ckpt(tmp_path / RUN / "epoch=0-step=5.ckpt", 5)
    _ckpt(
        tmp_path / RUN / "epoch=0-step=9.ckpt", 9, notes=[f"{i:064d}" for i in range(100)]
    )  # its pickle: over the bound
    assert _resolve(tmp_path) == str(kept.resolve())


def _archive(path: Path, pickled: bytes) -> None:
    """A torch.save-like archive (stored entries, as torch writes them) holding ``pickled`` as its data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/version", b"3\n")


def _names_code(path: Path) -> None:
    command = f"touch {path.parent / 'marker'}".encode()
    # os.system(command), as protocol 2 pickles it: run by a naive unpickler, it creates the marker.
    _archive(path, b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R.")


UNREADABLE: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "a step that is a string": (
        lambda path: torch.save({"global_step": "7", "state_dict": {}}, path),
        CheckpointError,
        "['global_step']",
    ),
    "a pickle that names code": (_names_code, UnsafeCheckpointError, "os.system"),
    "a pickle that is not one": (
        lambda path: _archive(path, b"\x00not a pickle"),
        CheckpointError,
        "is not a checkpoint torch can read",
    ),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_complete_checkpoint_whose_progress_cannot_be_read_stops_the_resume(tmp_path, case):
    make, error, fragment = UNREADABLE[case]
    _ckpt(tmp_path / RUN / "epoch=0-step=1.ckpt", 1)
    make(tmp_path / RUN / "epoch=0-step=2.ckpt")
    with pytest.raises(error) as raised:
        _resolve(tmp_path)
    message = str(raised.value)
    assert fragment in message and "epoch=0-step=2.ckpt" in message and "pass the checkpoint" in message
    assert not (tmp_path / RUN / "marker").exists()


# ---------------------------------------------------------------------------- with the Trainer's defaults
def _default_trainer(max_epochs: int, **options: Any) -> phalanx.Trainer:
    return phalanx.Trainer(accelerator="cpu", max_epochs=max_epochs, enable_progress_bar=False, **options)


def test_with_defaults_auto_continues_the_experiment_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # default_root_dir: the working directory, as for a new user
    train, val = loaders()
    _default_trainer(1).fit(Regressor(), train, val)  # logs/version_0/checkpoints/epoch=0-step=8.ckpt
    first = tmp_path / "logs" / "version_0" / "checkpoints" / "epoch=0-step=8.ckpt"
    assert first.is_file()
    capsys.readouterr()

    resumed = _default_trainer(2)
    resumed.fit(Regressor(), train, val, ckpt_path="auto")
    assert resumed.ckpt_path == str(first.resolve()) and resumed.global_step == 16
    line = next(line for line in capsys.readouterr().out.splitlines() if "ckpt_path='auto'" in line)
    assert line.startswith(f"ckpt_path='auto': resuming from {first.resolve()} (global step 8, epoch 0): ")
    assert "the furthest recorded progress" in line or "the only complete checkpoint" in line

    other = _default_trainer(1)  # another model in the same folder: other hyper-parameters
    other.fit(Regressor(hidden=8), train, val, ckpt_path="auto")
    assert other.ckpt_path is None and other.global_step == 8
    line = next(line for line in capsys.readouterr().out.splitlines() if "ckpt_path='auto'" in line)
    assert "no complete checkpoint" in line and "other hyper-parameters" in line

    own = _default_trainer(1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "mine")])
    own.fit(Regressor(), train, val, ckpt_path="auto")  # its own empty folder: nobody else's weights
    assert own.ckpt_path is None and own.global_step == 8
