"""A logger that records runs in MLflow (needs the optional ``mlflow`` package: ``pip install 'phalanx[trackers]'``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from phalanx.loggers.csv import save_hparams_to_yaml
from phalanx.loggers.logger import Logger, rank_zero_experiment
from phalanx.loggers.utilities import add_prefix, checkpoints_to_log, convert_params, flatten_dict, to_scalar
from phalanx.utilities.rank_zero import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from phalanx.callbacks.model_checkpoint import ModelCheckpoint

_MISSING_MESSAGE = "MLFlowLogger needs the optional `mlflow` package: pip install 'phalanx[trackers]' (or 'mlflow')."
_FILE_PREFIX = "file:"
# What MLflow keeps of a metric name (other characters are dropped, with a warning), as Lightning does.
_METRIC_NAME_DROPPED = re.compile(r"[^a-zA-Z0-9_/. -]+")
_PARAM_VALUE_LENGTH = 250  # Lightning's cut, kept so that a run logged either way holds the same parameters
_STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def _mlflow_version() -> tuple[int, ...]:
    if importlib.util.find_spec("mlflow") is None:
        raise ModuleNotFoundError(_MISSING_MESSAGE)
    version = importlib.metadata.version("mlflow")
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def _refuses_file_stores() -> bool:
    """Whether this mlflow refuses ``file:`` tracking stores (mlflow 3.x unless MLFLOW_ALLOW_FILE_STORE is true)."""
    from mlflow import environment_variables  # optional dependency, checked by _mlflow_version

    allowed = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return allowed is not None and not allowed.get()


class MLFlowLogger(Logger):
    """Log metrics, hyperparameters and, when asked, checkpoints to an MLflow run.

    Global rank 0 creates (or resumes) the run when a stage starts and writes to it; the other ranks take its run id,
    so every rank names the same run (``version``) and checkpoint folder. ``experiment`` is the
    :class:`mlflow.tracking.MlflowClient` on rank 0 (a do-nothing stand-in elsewhere). Every argument is checked here,
    not at the first write.

    Args:
        experiment_name: The experiment (created when missing).
        run_name: The run's name (the ``mlflow.runName`` tag).
        tracking_uri: ``file:<folder>``, ``sqlite:///<file>``, ``http(s)://host:port`` of an ``mlflow server``, or any
            URI mlflow takes; default: the ``MLFLOW_TRACKING_URI`` environment variable, else ``file:<save_dir>``.
        tags: Tags of a new run.
        save_dir: The folder of the default ``file:`` URI (the file store: mlflow 3 wants MLFLOW_ALLOW_FILE_STORE=true).
        log_model: Upload ModelCheckpoint's files as artifacts: ``"all"`` each once it is written, True at the end of a
            successful stage (each one written with ``save_top_k=-1``), False never.
        prefix: Put before every metric name, with ``-``.
        artifact_location: The artifact location of a new experiment.
        run_id: Resume this run instead of creating one.
        synchronous: Wait for each logging call (True) or let mlflow log in the background (False).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | os.PathLike | None = "./mlruns",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
    ) -> None:
        version = _mlflow_version()
        _check_arguments(experiment_name, run_name, tags, log_model, prefix, artifact_location, run_id, synchronous)
        if synchronous is not None and version < (2, 8):
            raise ModuleNotFoundError(
                "MLFlowLogger(synchronous=...) needs mlflow>=2.8: pip install 'phalanx[trackers]'."
            )
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        if tracking_uri is None:
            if save_dir is None:
                raise ValueError("MLFlowLogger needs a tracking_uri or a save_dir (the folder of a file: store).")
            tracking_uri = f"{_FILE_PREFIX}{os.fspath(save_dir)}"
        if not isinstance(tracking_uri, str) or not tracking_uri:
            raise TypeError(f"MLFlowLogger(tracking_uri={tracking_uri!r}): pass a non-empty str URI.")
        if tracking_uri.startswith(_FILE_PREFIX) and _refuses_file_stores():
            raise ValueError(
                f"MLFlowLogger(tracking_uri={tracking_uri!r}): mlflow {importlib.metadata.version('mlflow')} refuses"
                " file: stores unless the environment variable MLFLOW_ALLOW_FILE_STORE=true is set."
                " Set it, or log to a database instead: tracking_uri='sqlite:///path/to/mlflow.db'."
            )
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tracking_uri = tracking_uri
        self.tags = dict(tags) if tags is not None else None
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
        self._client: MlflowClient | None = None
        self._logged_model_time: dict[str, float] = {}
        self._checkpoint_callback: ModelCheckpoint | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> MlflowClient:
        """The ``MlflowClient`` of this run, which is created or resumed on first access (rank 0 only)."""
        if self._client is not None:
            return self._client
        from mlflow.tracking import MlflowClient  # optional dependency, checked at construction

        client = MlflowClient(self._tracking_uri)
        if self._run_id is not None:
            self._experiment_id = client.get_run(self._run_id).info.experiment_id
        else:
            self._experiment_id = self._experiment_id or self._find_or_create_experiment(client)
            tags = dict(self.tags or {})
            if self._run_name is not None:
                from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME  # optional dependency

                if MLFLOW_RUN_NAME in tags:
                    rank_zero_warn(f"MLFlowLogger: run_name={self._run_name!r} replaces the tag {MLFLOW_RUN_NAME}.")
                tags[MLFLOW_RUN_NAME] = self._run_name
            from mlflow.tracking.context.registry import resolve_tags  # optional dependency

            run = client.create_run(experiment_id=self._experiment_id, tags=resolve_tags(tags))
            self._run_id = run.info.run_id
        self._client = client
        return client

    def _find_or_create_experiment(self, client: MlflowClient) -> str:
        found = client.get_experiment_by_name(self._experiment_name)
        if found is not None and found.lifecycle_stage != "deleted":
            return found.experiment_id
        return client.create_experiment(name=self._experiment_name, artifact_location=self._artifact_location)

    @property
    def run_id(self) -> str | None:
        """The run's id (on rank 0 the run is created here if it was not yet)."""
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        """The experiment's id (on rank 0 the run is created here if it was not yet)."""
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> str:
        """The experiment id (the folder level of the default checkpoint folder, as in Lightning)."""
        return self.experiment_id or ""

    @property
    def version(self) -> str:
        """The run id ("" on a rank other than 0 before the stage shares it)."""
        return self.run_id or ""

    @property
    def save_dir(self) -> str | None:
        """The folder of a ``file:`` tracking URI, else None."""
        if self._tracking_uri.startswith(_FILE_PREFIX):
            return self._tracking_uri[len(_FILE_PREFIX) :]
        return None

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log the metrics at ``step`` (0 when None), in one batch; string values are skipped with a warning."""
        from mlflow.entities import Metric  # optional dependency

        timestamp = int(time.time() * 1000)
        batch = []
        for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, str):
                rank_zero_warn(f"MLFlowLogger: the metric {key}={value!r} is a string; it is not logged.")
                continue
            kept = _METRIC_NAME_DROPPED.sub("", key)
            if kept != key:
                rank_zero_warn(
                    f"MLFlowLogger: MLflow takes only letters, digits, '_/. -' in names: {key!r} is {kept!r}."
                )
            batch.append(Metric(key=kept, value=float(to_scalar(key, value)), timestamp=timestamp, step=step or 0))
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.experiment.log_batch(run_id=self.run_id, metrics=batch[start : start + 1000], **self._batch_kwargs)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        """Log the hyperparameters, flattened (``a/b``), as strings of at most 250 characters."""
        from mlflow.entities import Param  # optional dependency

        flat = flatten_dict(convert_params(params))
        batch = [Param(key=key, value=str(value)[:_PARAM_VALUE_LENGTH]) for key, value in flat.items()]
        for start in range(0, len(batch), 100):  # MLflow takes at most 100 parameters per batch
            self.experiment.log_batch(run_id=self.run_id, params=batch[start : start + 100], **self._batch_kwargs)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Upload the checkpoints ``log_model=True`` waits for, and end the run: FINISHED, FAILED or KILLED."""
        if self._client is None:
            return
        if self._checkpoint_callback is not None:
            self._log_checkpoints(self._checkpoint_callback)
        self._client.set_terminated(self._run_id, _STATUS.get(status, "FINISHED"))

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """With ``log_model="all"`` (or True and ``save_top_k=-1``): upload the checkpoints written since last time."""
        if self._log_model == "all" or (self._log_model is True and checkpoint_callback.save_top_k == -1):
            self._log_checkpoints(checkpoint_callback)
        elif self._log_model is True:
            self._checkpoint_callback = checkpoint_callback

    @rank_zero_only
    def _log_checkpoints(self, checkpoint_callback: ModelCheckpoint) -> None:
        client, run_id = self.experiment, self.run_id
        for mtime, path, score, _ in checkpoints_to_log(checkpoint_callback, self._logged_model_time):
            folder = Path(path).stem
            client.log_artifact(run_id, path, folder)
            metadata = {
                "score": score.item() if hasattr(score, "item") else score,
                "original_filename": Path(path).name,
                "Checkpoint": _checkpoint_options(checkpoint_callback),
            }
            aliases = ["latest", "best"] if path == checkpoint_callback.best_model_path else ["latest"]
            with tempfile.TemporaryDirectory() as scratch:
                save_hparams_to_yaml(os.path.join(scratch, "metadata.yaml"), metadata)
                Path(scratch, "aliases.txt").write_text(str(aliases))
                client.log_artifacts(run_id, scratch, folder)
            self._logged_model_time[path] = mtime

    def shared_state(self) -> dict[str, Any]:
        """The run (created here on rank 0 when the first stage starts) for the other ranks."""
        return {"run_id": self.run_id, "experiment_id": self.experiment_id}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Name rank 0's run (this rank never writes to it)."""
        self._run_id, self._experiment_id = state.get("run_id"), state.get("experiment_id")

    def worker_state(self) -> dict[str, Any]:
        """The run rank 0 wrote to, for the main process after a spawned stage."""
        return {"run_id": self._run_id, "experiment_id": self._experiment_id}

    def load_worker_state(self, state: dict[str, Any]) -> None:
        """Later stages resume the run rank 0 wrote to (instead of creating another)."""
        if self._run_id is None:
            self._run_id, self._experiment_id = state.get("run_id"), state.get("experiment_id")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # a client holds connections; the copy makes its own on first use
        return state


def _checkpoint_options(checkpoint_callback: Any) -> dict[str, Any]:
    names = ("monitor", "mode", "save_last", "save_top_k", "save_weights_only", "_every_n_train_steps")
    return {name: getattr(checkpoint_callback, name) for name in names if hasattr(checkpoint_callback, name)}


def _check_arguments(
    experiment_name: Any,
    run_name: Any,
    tags: Any,
    log_model: Any,
    prefix: Any,
    artifact_location: Any,
    run_id: Any,
    synchronous: Any,
) -> None:
    """Refuse, at construction, what mlflow would refuse at the first write."""
    if not isinstance(experiment_name, str) or not experiment_name:
        raise TypeError(f"MLFlowLogger(experiment_name={experiment_name!r}): pass a non-empty str.")
    for name, value in (("run_name", run_name), ("artifact_location", artifact_location), ("run_id", run_id)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"MLFlowLogger({name}={value!r}): pass a non-empty str or None.")
    if tags is not None and not isinstance(tags, dict):
        raise TypeError(f"MLFlowLogger(tags={tags!r}): pass a dict of tag names to values, or None.")
    if not (log_model is True or log_model is False or log_model == "all"):
        raise ValueError(f"MLFlowLogger(log_model={log_model!r}): pass True, False or 'all'.")
    if not isinstance(prefix, str):
        raise TypeError(f"MLFlowLogger(prefix={prefix!r}): pass a str.")
    if synchronous is not None and not isinstance(synchronous, bool):
        raise TypeError(f"MLFlowLogger(synchronous={synchronous!r}): pass True, False or None.")
