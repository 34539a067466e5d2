"""The public Logger contract: a logger of one's own needs nothing private (``rank_zero_experiment`` and the helpers of
``phalanx.loggers.utilities``), rank 0 alone holds the experiment, ``shared_state`` reaches the other ranks, and
``after_save_checkpoint`` comes once the checkpoint is complete on disk, with AsyncCheckpointIO too."""

from __future__ import annotations

import argparse
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import Callback, ModelCheckpoint
from phalanx.loggers import DummyExperiment, Logger, rank_zero_experiment
from phalanx.loggers.utilities import (
    add_prefix,
    checkpoints_to_log,
    convert_params,
    flatten_dict,
    sanitize_callable_params,
    to_json_values,
    to_scalar,
)
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from phalanx.utilities.rank_zero import rank_zero_only


@dataclass
class _Optim:
    lr: float = 0.1
    betas: tuple = (0.9, 0.99)


HELPER_CASES = [
    ("convert_params", lambda: convert_params(None), {}),
    (
        "convert_params",
        lambda: convert_params(argparse.Namespace(a=1, b=argparse.Namespace(c=2))),
        {"a": 1, "b": {"c": 2}},
    ),
    ("flatten_dict", lambda: flatten_dict({"a": {"b": {"c": 1}}, "d": 2}), {"a/b/c": 1, "d": 2}),
    ("flatten_dict", lambda: flatten_dict({"o": _Optim()}, delimiter="."), {"o.lr": 0.1, "o.betas": (0.9, 0.99)}),
    (
        "flatten_dict",
        lambda: flatten_dict({"l": [{"a": 1}, {"b": 2}], "m": [1, 2]}),
        {"l/0/a": 1, "l/1/b": 2, "m": [1, 2]},
    ),
    ("flatten_dict", lambda: flatten_dict({5: argparse.Namespace(x=1)}), {"5/x": 1}),
    (
        "sanitize",
        lambda: sanitize_callable_params({"act": torch.nn.ReLU, "f": len, "n": 3}),
        {"act": "ReLU", "f": "len", "n": 3},
    ),
    (
        "to_json_values",
        lambda: to_json_values({"t": torch.float16, "l": [1, 2], "n": None}),
        {"t": "torch.float16", "l": [1, 2], "n": None},
    ),
    ("add_prefix", lambda: add_prefix({"loss": 1}, "train"), {"train-loss": 1}),
    ("add_prefix", lambda: add_prefix({"loss": 1}, "train", "/"), {"train/loss": 1}),
    ("add_prefix", lambda: add_prefix({"loss": 1}, ""), {"loss": 1}),
    (
        "to_scalar",
        lambda: [to_scalar("x", v) for v in (True, 3, 0.5, torch.tensor(2.5), torch.tensor([7]))],
        [1, 3, 0.5, 2.5, 7],
    ),
]


@pytest.mark.parametrize(
    ("helper", "call", "expected"), HELPER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HELPER_CASES)]
)
def test_public_helpers(helper, call, expected):
    assert call() == expected


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: convert_params([1, 2]), TypeError, "dict or argparse.Namespace"),
        (lambda: to_scalar("x", torch.ones(2)), ValueError, "'x' must be a scalar"),
        (lambda: to_scalar("x", "high"), TypeError, "'x' must be a number"),
        (lambda: to_scalar("x", 1j), TypeError, "'x' must be a number"),
    ],
)
def test_public_helpers_refuse_what_no_tracker_stores(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_checkpoints_to_log_lists_whole_files_once_and_again_when_rewritten(tmp_path):
    best, last, pending = tmp_path / "best.ckpt", tmp_path / "last.ckpt", tmp_path / "not-written-yet.ckpt"
    best.write_bytes(b"b")
    last.write_bytes(b"l")
    callback = argparse.Namespace(
        last_model_path=str(last),
        current_score=torch.tensor(0.5),
        best_model_path=str(best),
        best_model_score=torch.tensor(0.25),
        best_k_models={str(best): torch.tensor(0.25), str(pending): torch.tensor(0.3)},
    )
    found = checkpoints_to_log(callback, {})
    assert {(path, tag) for _, path, _, tag in found} == {(str(best), "best_k"), (str(last), "latest")}
    logged = {path: mtime for mtime, path, _, _ in found}
    assert checkpoints_to_log(callback, logged) == []
    os.utime(last, (logged[str(last)] + 5, logged[str(last)] + 5))  # last.ckpt rewritten under its name
    assert [path for _, path, _, _ in checkpoints_to_log(callback, logged)] == [str(last)]


class _Recorder:
    """The experiment object of the logger below: records what it is given."""

    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict[str, float]]] = []
        self.params: dict[str, Any] = {}


class RecordingLogger(Logger):
    """A logger written as a user would, with public names only."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._experiment: _Recorder | None = None
        self.checkpoints: list[str] = []
        self.graphs: list[str] = []
        self.run_name: str | None = None

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return self.run_name or ""

    @property
    @rank_zero_experiment
    def experiment(self) -> _Recorder:
        if self._experiment is None:
            self._experiment = _Recorder()
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {key: to_scalar(key, value) for key, value in add_prefix(metrics, self._prefix).items()}
        self.experiment.rows.append((step, values))

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        self.experiment.params.update(flatten_dict(convert_params(params)))

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        self.graphs.append(type(model).__name__)

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        self.checkpoints.append(os.path.basename(checkpoint_callback.best_model_path))

    def shared_state(self) -> dict[str, Any]:
        self.run_name = self.run_name or "run-1"
        return {"run": self.run_name}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        self.run_name = state["run"]


def test_a_users_logger_with_public_names_only_under_the_trainers_defaults(tmp_path):
    logger = RecordingLogger(prefix="p")
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=2, log_every_n_steps=1, logger=logger, default_root_dir=tmp_path
    )
    trainer.fit(Regressor(), *loaders(n=32))  # defaults on: sanity check, checkpoints, progress bar, summary
    rows = logger.experiment.rows
    assert {key for _, values in rows for key in values} == {"p-train_loss", "p-val_loss", "p-epoch"}
    assert [step for step, values in rows if "p-val_loss" in values] == [3, 7]
    assert logger.experiment.params == {"features": 4, "hidden": 16, "lr": 0.05, "dropout": 0.0}
    assert logger.graphs == ["Regressor"]
    assert logger.version == "run-1"  # shared_state() ran on rank 0 when the stage started
    # The default ModelCheckpoint names its folder after the logger: save_dir (default_root_dir)/name/version.
    assert Path(trainer.checkpoint_callback.dirpath) == Path(tmp_path).resolve() / "recorder" / "run-1" / "checkpoints"
    assert logger.checkpoints == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]  # once per checkpoint written


@pytest.mark.parametrize(("rank", "real"), [(0, True), (1, False)])
def test_rank_zero_experiment_gives_other_ranks_a_dummy(monkeypatch, rank, real):
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    logger = RecordingLogger()
    experiment = logger.experiment
    assert isinstance(experiment, _Recorder) == real
    assert isinstance(experiment, DummyExperiment) != real
    logger.log_metrics({"x": 1.0}, step=0)
    assert (logger._experiment is not None) == real  # nothing is created on the other ranks
    if not real:
        assert experiment.anything(1, key=2) is None and experiment[0] is experiment


class _GatedIO(TorchCheckpointIO):
    """Holds every write back until the gate opens (opened at the end of fit, before the writes are awaited)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        assert self.gate.wait(timeout=120), "the test never opened the gate"
        super().save_checkpoint(checkpoint, path, storage_options)


class _OpenAtFitEnd(Callback):
    def __init__(self, io: _GatedIO) -> None:
        self.io = io

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.io.gate.set()


class _SeesTheFile(Logger):
    """Notes, in after_save_checkpoint, whether the checkpoint is a whole file and on which thread it is told."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[bool, int | None, bool]] = []
        self.fail = fail

    name = "seer"  # type: ignore[assignment]
    version = 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        path = checkpoint_callback.best_model_path
        whole = os.path.isfile(path)
        step = torch.load(path, weights_only=True)["global_step"] if whole else None
        self.seen.append((whole, step, threading.current_thread() is threading.main_thread()))
        if self.fail:
            raise RuntimeError("upload refused")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_after_save_checkpoint_sees_the_whole_checkpoint(tmp_path, asynchronous):
    io = _GatedIO()
    seer = _SeesTheFile()
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)]
    if asynchronous:
        plugins: list[Any] = [AsyncCheckpointIO(io)]
        callbacks.append(_OpenAtFitEnd(io))
    else:
        plugins = [io]
        io.gate.set()
    trainer = quiet_trainer(max_epochs=1, logger=seer, callbacks=callbacks, enable_checkpointing=True, plugins=plugins)
    trainer.fit(Regressor(), loaders(n=32)[0])
    # Told once, after the write (under AsyncCheckpointIO on its writer's thread, once the held-back write is done).
    assert seer.seen == [(True, 4, not asynchronous)]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failing_after_save_checkpoint_is_raised_or_reported_never_taken_for_a_failed_save(tmp_path, asynchronous):
    seer = _SeesTheFile(fail=True)
    callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last="link")
    plugins = [AsyncCheckpointIO(TorchCheckpointIO())] if asynchronous else None
    trainer = quiet_trainer(max_epochs=2, logger=seer, callbacks=[callback], enable_checkpointing=True, plugins=plugins)
    if not asynchronous:  # on the training thread, as in Lightning: the error stops the run
        with pytest.raises(RuntimeError, match="upload refused"):
            trainer.fit(Regressor(), loaders(n=32)[0])
        return
    with pytest.warns(UserWarning, match=r"_SeesTheFile.after_save_checkpoint failed once .*epoch=0-step=4.ckpt"):
        trainer.fit(Regressor(), loaders(n=32)[0])
    # The writes after it went on: both checkpoints, and last.ckpt links to the newest.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=8.ckpt"


class _Rank:
    """One rank's end of a broadcast: rank 0 records what it sends, the other ranks receive it."""

    def __init__(self, rank: int, channel: list) -> None:
        self.is_global_zero, self.channel = rank == 0, channel

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.is_global_zero:
            self.channel.append(obj)
            return obj
        return self.channel[-1]


def test_every_rank_adopts_the_run_rank_zero_shares(tmp_path, monkeypatch):
    from phalanx.loggers import CSVLogger
    from phalanx.loggers.logger import share_logger_states

    channel: list = []
    ranks = {}
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        loggers = [CSVLogger(tmp_path), RecordingLogger()]
        share_logger_states(loggers, _Rank(rank, channel))
        ranks[rank] = [logger.version for logger in loggers]
    assert ranks[0] == ranks[1] == [0, "run-1"]
    assert channel == [[{"version": 0}, {"run": "run-1"}]]  # one broadcast, from rank 0
