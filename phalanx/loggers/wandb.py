"""A logger that records runs in Weights & Biases (needs the optional ``wandb`` package:
``pip install 'phalanx[trackers]'``)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import multiprocessing
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from phalanx.loggers.logger import Logger, rank_zero_experiment
from phalanx.loggers.utilities import (
    add_prefix,
    checkpoints_to_log,
    convert_params,
    sanitize_callable_params,
    to_json_values,
    to_scalar,
)
from phalanx.utilities.rank_zero import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from torch import nn
    from wandb import Artifact
    from wandb.sdk.wandb_run import Run

    from phalanx.callbacks.model_checkpoint import ModelCheckpoint

_MISSING_MESSAGE = "WandbLogger needs the optional `wandb` package: pip install 'phalanx[trackers]' (or 'wandb')."
_STEP = "trainer/global_step"
# wandb.init's keywords that WandbLogger's own arguments set.
_OWN = {"name", "project", "dir", "id", "anonymous"}


def _wandb_init_keywords() -> set[str]:
    """The keywords ``wandb.init`` takes (imports wandb)."""
    if importlib.util.find_spec("wandb") is None:
        raise ModuleNotFoundError(_MISSING_MESSAGE)
    import wandb  # optional dependency, found above

    return set(inspect.signature(wandb.init).parameters)


class WandbLogger(Logger):
    """Log metrics, hyperparameters (the run's config), media and, when asked, checkpoints to a W&B run.

    Global rank 0 creates the run (or resumes ``id``) when a stage starts and writes to it; the other ranks take its
    id, so every rank names the same run (``version``) and checkpoint folder. ``experiment`` is the ``wandb`` run on
    rank 0 (a do-nothing stand-in elsewhere). Every argument is checked here, not at the first write. A run this
    logger created stays open after a stage, as in Lightning (wandb finishes it when the process exits; call
    ``wandb.finish()`` to end it sooner), except in a process started by ``multiprocessing`` (``ddp_spawn`` and
    ``ddp_fork`` workers), which exits without running wandb's exit hook: there it is finished at the end of each stage,
    and a later stage resumes it by id.

    Args:
        name: The run's display name.
        save_dir: The folder wandb writes its ``wandb/`` run folders under (created if missing).
        version: The run id, to resume it (``resume="allow"``); the same as ``id``.
        offline: Write the run locally only (``wandb sync`` uploads it later).
        dir: The same as ``save_dir``.
        id: The same as ``version``.
        anonymous: Allow anonymous logging.
        project: The project; default: the ``WANDB_PROJECT`` environment variable, else ``"lightning_logs"``.
        log_model: Log ModelCheckpoint's files as ``model`` artifacts: ``"all"`` each once it is written, True at the
            end of a successful stage (each one written with ``save_top_k=-1``), False never; not with ``offline``.
        experiment: A run to log to instead of creating one (never finished by this logger).
        prefix: Put before every metric name, with ``-``.
        checkpoint_name: The artifact's name (default ``model-<run id>``).
        add_file_policy: ``"mutable"`` copies a checkpoint before uploading it, ``"immutable"`` does not.
        **kwargs: Other keywords of ``wandb.init`` (``entity``, ``group``, ``tags``, ``config``, ``mode``, ...).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike | None = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: Literal["all"] | bool = False,
        experiment: Any = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        add_file_policy: Literal["mutable", "immutable"] = "mutable",
        **kwargs: Any,
    ) -> None:
        accepted = _wandb_init_keywords()
        _check_arguments(offline, log_model, prefix, add_file_policy, version, id)
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(
                f"WandbLogger got unexpected keyword arguments {unknown}: besides its own, it takes the keywords of"
                f" wandb.init: {sorted(accepted - set(_OWN))}."
            )
        folder = dir if dir is not None else save_dir
        if dir is not None and save_dir not in (None, ".") and os.fspath(dir) != os.fspath(save_dir):
            raise ValueError(f"WandbLogger(save_dir={save_dir!r}, dir={dir!r}): they are one option; pass one of them.")
        self._offline = offline
        self._log_model = log_model
        self._prefix = prefix
        self._experiment = experiment
        self._owns_run = False  # whether this logger created its run (it then may finish it)
        self._logged_model_time: dict[str, float] = {}
        self._checkpoint_callbacks: dict[int, ModelCheckpoint] = {}
        self._checkpoint_name = checkpoint_name
        self.add_file_policy = add_file_policy
        self._wandb_init: dict[str, Any] = {
            "name": name,
            "project": project or os.environ.get("WANDB_PROJECT", "lightning_logs"),
            "dir": os.fspath(folder) if folder is not None else None,
            "id": version or id,
            "resume": "allow",
            **({"anonymous": "allow"} if anonymous else {}),
            **kwargs,
        }
        if offline:
            self._wandb_init["mode"] = "offline"
        self._id: str | None = self._wandb_init["id"]

    @property
    @rank_zero_experiment
    def experiment(self) -> Run:
        """The wandb run, created (or resumed by id) on first access on rank 0."""
        if self._experiment is not None:
            return self._experiment
        import wandb  # optional dependency, checked at construction

        if wandb.run is not None:
            rank_zero_warn(
                "WandbLogger: a wandb run is already in progress; it is used instead of a new one. Call"
                " wandb.finish() before the Trainer starts if that is not what you want."
            )
            self._experiment = wandb.run
        else:
            init = dict(self._wandb_init, id=self._id)
            if init["dir"] is not None:
                os.makedirs(init["dir"], exist_ok=True)
            self._experiment = wandb.init(**init)
            self._owns_run = True
            if init.get("sync_tensorboard"):
                self._experiment.define_metric("*", step_metric="global_step")
            else:
                self._experiment.define_metric(_STEP)
                self._experiment.define_metric("*", step_metric=_STEP, step_sync=True)
        self._id = self._experiment.id
        return self._experiment

    @property
    def name(self) -> str:
        """The project (the folder level of the default checkpoint folder, as in Lightning)."""
        return self._wandb_init["project"]

    @property
    def version(self) -> str:
        """The run's id ("" before the run exists on rank 0, or before a stage shares it with the other ranks)."""
        return self._experiment.id if self._experiment is not None else (self._id or "")

    @property
    def save_dir(self) -> str | None:
        """The folder wandb writes under."""
        return self._wandb_init["dir"]

    def watch(
        self, model: nn.Module, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True
    ) -> None:
        """Log ``model``'s gradients (``log="gradients"``), parameters or both (``"all"``) every ``log_freq`` steps."""
        if log not in ("gradients", "parameters", "all", None):
            raise ValueError(f"WandbLogger.watch(log={log!r}): pass 'gradients', 'parameters', 'all' or None.")
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        """Add the hyperparameters to the run's config (values JSON cannot hold as their ``str``)."""
        params = to_json_values(sanitize_callable_params(convert_params(params)))
        self.experiment.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log the metrics, with ``trainer/global_step`` = ``step`` (numbers and tensors as numbers; wandb objects as
        they are)."""
        values = {
            key: to_scalar(key, value) if _is_number_like(value) else value
            for key, value in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items()
        }
        if step is not None and not self._wandb_init.get("sync_tensorboard"):
            values[_STEP] = step
        self.experiment.log(values)

    @rank_zero_only
    def log_table(
        self,
        key: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
    ) -> None:
        """Log a ``wandb.Table`` from ``columns`` and ``data``, or from a ``dataframe``."""
        import wandb  # optional dependency, checked at construction

        self.log_metrics({key: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step)

    def log_text(
        self,
        key: str,
        columns: list[str] | None = None,
        data: list[list[str]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
    ) -> None:
        """Log text as a table."""
        self.log_table(key, columns, data, dataframe, step)

    def log_image(self, key: str, images: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log images (tensors, arrays, PIL images, paths); each keyword is a list with one entry per image."""
        self._log_media("Image", key, images, step, kwargs)

    def log_audio(self, key: str, audios: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log audio clips (arrays or paths); each keyword (``caption``, ``sample_rate``) is a list, one per clip."""
        self._log_media("Audio", key, audios, step, kwargs)

    def log_video(self, key: str, videos: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log videos (arrays or paths); each keyword (``caption``, ``fps``, ``format``) is a list, one per video."""
        self._log_media("Video", key, videos, step, kwargs)

    @rank_zero_only
    def _log_media(
        self, kind: str, key: str, items: list[Any], step: int | None, options: dict[str, list[Any]]
    ) -> None:
        if not isinstance(items, list):
            raise TypeError(f"WandbLogger.log_{kind.lower()}({key!r}, ...) takes a list, got {type(items).__name__}.")
        for option, values in options.items():
            if len(values) != len(items):
                raise ValueError(
                    f"WandbLogger.log_{kind.lower()}({key!r}, {option}=...): give one entry per item"
                    f" ({len(items)}), got {len(values)}."
                )
        import wandb  # optional dependency, checked at construction

        make = getattr(wandb, kind)
        media = [make(item, **{name: values[i] for name, values in options.items()}) for i, item in enumerate(items)]
        self.log_metrics({key: media}, step)

    def use_artifact(self, artifact: str, artifact_type: str | None = None) -> Artifact:
        """Mark ``artifact`` as used by this run and return it."""
        return self.experiment.use_artifact(artifact, type=artifact_type)

    @staticmethod
    @rank_zero_only
    def download_artifact(
        artifact: str,
        save_dir: str | os.PathLike | None = None,
        artifact_type: str | None = None,
        use_artifact: bool | None = True,
    ) -> str:
        """Download ``artifact`` (through the current run if there is one and ``use_artifact``); returns its folder."""
        import wandb  # optional dependency

        if wandb.run is not None and use_artifact:
            found = wandb.run.use_artifact(artifact)
        else:
            found = wandb.Api().artifact(artifact, type=artifact_type)
        return found.download(root=None if save_dir is None else os.fspath(save_dir))

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """With ``log_model="all"`` (or True and ``save_top_k=-1``): log the checkpoints written since the last call."""
        if self._log_model == "all" or (self._log_model is True and checkpoint_callback.save_top_k == -1):
            self._log_checkpoints(checkpoint_callback)
        elif self._log_model is True:
            self._checkpoint_callbacks[id(checkpoint_callback)] = checkpoint_callback

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Log the checkpoints ``log_model=True`` waits for (after a successful stage); in a worker process started
        by multiprocessing, finish the run this logger created."""
        if self._experiment is None:
            return
        if status == "success":
            for checkpoint_callback in self._checkpoint_callbacks.values():
                self._log_checkpoints(checkpoint_callback)
        if self._owns_run and multiprocessing.parent_process() is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment, self._owns_run = None, False

    @rank_zero_only
    def _log_checkpoints(self, checkpoint_callback: ModelCheckpoint) -> None:
        import wandb  # optional dependency, checked at construction

        run = self.experiment
        for mtime, path, score, _ in checkpoints_to_log(checkpoint_callback, self._logged_model_time):
            options = ("monitor", "mode", "save_last", "save_top_k", "save_weights_only", "_every_n_train_steps")
            metadata = {
                "score": score.item() if hasattr(score, "item") else score,
                "original_filename": Path(path).name,
                type(checkpoint_callback).__name__: {
                    name: getattr(checkpoint_callback, name) for name in options if hasattr(checkpoint_callback, name)
                },
            }
            artifact = wandb.Artifact(name=self._checkpoint_name or f"model-{run.id}", type="model", metadata=metadata)
            artifact.add_file(path, name="model.ckpt", policy=self.add_file_policy)
            aliases = ["latest", "best"] if path == checkpoint_callback.best_model_path else ["latest"]
            run.log_artifact(artifact, aliases=aliases)
            self._logged_model_time[path] = mtime

    def shared_state(self) -> dict[str, Any]:
        """The run's id (the run is created here on rank 0 when the first stage starts) for the other ranks."""
        return {"id": self.experiment.id}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Name rank 0's run (this rank never writes to it)."""
        self._id = state.get("id") or self._id

    def worker_state(self) -> dict[str, Any]:
        """The run rank 0 wrote to, for the main process after a spawned stage."""
        return {"id": self.version or None}

    def load_worker_state(self, state: dict[str, Any]) -> None:
        """Later stages resume the run rank 0 wrote to (instead of creating another)."""
        if self._experiment is None:
            self._id = state.get("id") or self._id

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._experiment is not None:
            state["_id"] = self._experiment.id  # a copy in another process resumes this run by its id
        state["_experiment"], state["_owns_run"] = None, False
        return state


def _is_number_like(value: Any) -> bool:
    return isinstance(value, (int, float)) or (hasattr(value, "item") and hasattr(value, "numel"))


def _check_arguments(offline: Any, log_model: Any, prefix: Any, policy: Any, version: Any, id: Any) -> None:
    """Refuse, at construction, what Lightning or wandb would refuse later."""
    if not isinstance(offline, bool):
        raise TypeError(f"WandbLogger(offline={offline!r}): pass True or False.")
    if not (log_model is True or log_model is False or log_model == "all"):
        raise ValueError(f"WandbLogger(log_model={log_model!r}): pass True, False or 'all'.")
    if offline and log_model:
        raise ValueError(
            f"WandbLogger(offline=True, log_model={log_model!r}): checkpoints are uploaded as artifacts, which an"
            " offline run does not do; pass offline=False to log models, or log_model=False to stay offline."
        )
    if not isinstance(prefix, str):
        raise TypeError(f"WandbLogger(prefix={prefix!r}): pass a str.")
    if policy not in ("mutable", "immutable"):
        raise ValueError(f"WandbLogger(add_file_policy={policy!r}): pass 'mutable' or 'immutable'.")
    if version is not None and id is not None and version != id:
        raise ValueError(f"WandbLogger(version={version!r}, id={id!r}): they are one option; pass one of them.")
