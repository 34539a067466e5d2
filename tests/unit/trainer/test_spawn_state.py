"""What the main process takes over from global rank 0 after a spawned or forked stage (``TrainerWorkerState``): the
weights and progress, the checkpoint callbacks' results and folders, and the loggers' versions, so that later stages
reuse the same version folder and find the same checkpoints.

The worker is simulated in this process: a pickled copy of the main Trainer (what a spawned worker receives) runs the
stage, its state is collected and restored into the main Trainer, as the multiprocessing launcher does.
"""

from __future__ import annotations

import argparse
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
from phalanx_testing import Regressor, loaders

import phalanx
from phalanx.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from phalanx.loggers import CSVLogger, Logger, TensorBoardLogger
from phalanx.loggers.tensorboard import _tensorboard_available
from phalanx.trainer.spawn_state import TrainerWorkerState


class NoFilesLogger(Logger):
    """A logger that writes no local files (a hosted service's): it hands nothing back."""

    @property
    def name(self) -> str:
        return "remote"

    @property
    def version(self) -> str:
        return "run-1"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        pass


LOGGERS: dict[str, Callable[[Path], Any]] = {
    "default": lambda root: None,
    "tensorboard": lambda root: TensorBoardLogger(root),
    "two csv": lambda root: [CSVLogger(root, name="a"), CSVLogger(root, name="b")],
    "no files": lambda root: NoFilesLogger(),
}
#: Warnings a later stage gave when the main process had not taken over rank 0's folders.
STALE = ("checkpoint folder changed", "already exists; new rows are appended")


def _spawned_fit(main: phalanx.Trainer, model: Regressor) -> phalanx.Trainer:
    """Fit in a copy of ``main`` (a worker's) and hand its state back to ``main`` as the launcher does."""
    worker, worker_model = pickle.loads(pickle.dumps((main, model)))
    train, val = loaders(n=32)
    worker.fit(worker_model, train, val)
    state = pickle.loads(pickle.dumps(TrainerWorkerState(worker, worker_model).collect()))
    TrainerWorkerState(main, model).restore(state)
    return worker


@pytest.mark.parametrize("logger", list(LOGGERS))
def test_later_stages_reuse_rank_zeros_version_folder_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logger: str
) -> None:
    if logger == "tensorboard" and not _tensorboard_available():
        pytest.skip("tensorboard is not installed")
    monkeypatch.chdir(tmp_path)
    main = phalanx.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=LOGGERS[logger](tmp_path),
        callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    worker = _spawned_fit(main, model)
    for ours, theirs in zip(main.loggers, worker.loggers):
        assert (ours.version, ours.log_dir) == (theirs.version, theirs.log_dir)
    callback, rank_zero = main.checkpoint_callback, worker.checkpoint_callback
    assert callback.best_model_path and Path(callback.last_model_path).is_file()
    for name in ("dirpath", "best_model_path", "best_model_score", "last_model_path", "best_k_models"):
        assert getattr(callback, name) == getattr(rank_zero, name), name
    assert (main.log_dir, main.global_step) == (worker.log_dir, worker.global_step)
    folders = sorted(path.name for path in tmp_path.rglob("version_*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = main.validate(model, loaders(n=32)[1], ckpt_path="last", verbose=False)
        main.test(model, loaders(n=32)[1], ckpt_path="best", verbose=False)
    assert results[0]["val_loss"] > 0 and main.ckpt_path == callback.best_model_path
    assert [str(w.message) for w in caught if any(text in str(w.message) for text in STALE)] == []
    assert sorted(path.name for path in tmp_path.rglob("version_*")) == folders
    assert main.log_dir == worker.log_dir


@pytest.mark.parametrize(("given", "kept"), [(None, 4), (7, 7), ("run_a", "run_a")])
def test_a_logger_takes_over_rank_zeros_version_unless_one_was_given(tmp_path: Path, given: Any, kept: Any) -> None:
    logger = CSVLogger(tmp_path, version=given)
    logger.load_worker_state({"version": 4, "hparams": {"lr": 0.1}})
    assert logger.version == kept and logger.hparams == {"lr": 0.1}
    assert not (tmp_path / "logs").exists()  # taking a version over claims no folder


class AddsCallbacks(Regressor):
    """A module whose configure_callbacks() adds or replaces callbacks (in the worker only: it runs there)."""

    def __init__(self, added: str) -> None:
        super().__init__()
        self.added = added  # a name, not a function: the module is pickled for the worker

    def configure_callbacks(self) -> Any:
        return MODULE_CALLBACKS[self.added]()


#: What configure_callbacks returns, beside a Trainer with a ModelCheckpoint and an EarlyStopping of its own.
MODULE_CALLBACKS: dict[str, Callable[[], Any]] = {
    "nothing": lambda: None,
    "a learning-rate monitor": lambda: LearningRateMonitor(),
    "an early stopping on another metric": lambda: EarlyStopping(monitor="train_loss", patience=5),
    "two callbacks": lambda: [LearningRateMonitor(), EarlyStopping(monitor="train_loss", patience=5)],
    "its own checkpoint callback": lambda: ModelCheckpoint(monitor="train_loss", save_top_k=2),
}


@pytest.mark.parametrize("added", list(MODULE_CALLBACKS))
def test_callback_states_come_back_by_state_key_whatever_configure_callbacks_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, added: str
) -> None:
    monkeypatch.chdir(tmp_path)
    checkpoint, stopping = ModelCheckpoint(monitor="val_loss", save_last=True), EarlyStopping(monitor="val_loss")
    main = phalanx.Trainer(
        accelerator="cpu", max_epochs=3, callbacks=[checkpoint, stopping], enable_model_summary=False
    )
    model = AddsCallbacks(added)
    worker = _spawned_fit(main, model)
    assert main.callbacks[-1] is checkpoint and main.checkpoint_callback is checkpoint  # its own list, not the worker's
    theirs = {callback.state_key: callback for callback in worker.callbacks}
    for callback in main.callbacks:
        if callback.state_key in theirs:  # the worker ran it: the same state here
            assert callback.state_dict() == theirs[callback.state_key].state_dict(), callback.state_key
    if added == "its own checkpoint callback":  # replaced in the worker: as Lightning, the best path comes back
        assert checkpoint.best_model_path == worker.checkpoint_callback.best_model_path != ""
    else:
        assert checkpoint.best_model_path == worker.checkpoint_callback.best_model_path != ""
        assert checkpoint.best_k_models == worker.checkpoint_callback.best_k_models
    if added != "an early stopping on another metric" and added != "two callbacks":
        assert stopping.state_dict() == theirs[stopping.state_key].state_dict()
