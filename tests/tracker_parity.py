"""One small project fitted under Lightning and under phalanx, and readers of what each tracker recorded (TensorBoard
event files, an MLflow store, W&B offline run files), for the Lightning-equivalence tables of the logger tests.

The project is written once against the Lightning names that phalanx shares (``self.log``, ``save_hyperparameters``,
``example_input_array``, ``configure_optimizers``); ``fit`` builds it on ``pytorch_lightning.LightningModule`` or on
``phalanx.TrainingModule`` and fits it with the same Trainer arguments, from the same seed, on the same data.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

FRAMEWORKS = ("phalanx", "lightning")
SAMPLES, FEATURES, BATCH_SIZE, EPOCHS = 32, 4, 8, 2
LIGHTNING_MISSING = "pytorch_lightning is not importable: the Lightning half of the table cannot run"


def lightning_available() -> bool:
    try:
        importlib.import_module("pytorch_lightning")
    except Exception:  # any import failure means the oracle cannot run
        return False
    return True


def framework(name: str) -> tuple[Any, Any, Any]:
    """(Trainer class, module base class, loggers module) of ``name``: "phalanx" or "lightning"."""
    if name == "lightning":
        import pytorch_lightning as pl
        import pytorch_lightning.loggers as loggers

        return pl.Trainer, pl.LightningModule, loggers
    import phalanx.loggers as loggers

    return phalanx.Trainer, phalanx.TrainingModule, loggers


def project_class(base: type) -> type:
    """The project module on ``base`` (for phalanx the module-level ``PhalanxProject``, which spawned workers load)."""
    if base is phalanx.TrainingModule and "PhalanxProject" in globals():
        return PhalanxProject

    class Project(base):  # type: ignore[misc, valid-type]
        def __init__(self, lr: float = 0.05, hidden: int = 8, note: str = "tiny") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
            self.example_input_array = torch.zeros(2, FEATURES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Project


PhalanxProject = project_class(phalanx.TrainingModule)
PhalanxProject.__qualname__ = PhalanxProject.__name__ = "PhalanxProject"


def loaders(shuffle: bool = False) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders. On several processes both frameworks give a shuffled training loader
    ``DistributedSampler(shuffle=True, seed=0)``; an unshuffled one only phalanx keeps in order."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=BATCH_SIZE, shuffle=shuffle), DataLoader(data, batch_size=BATCH_SIZE)


def fit(
    name: str,
    make_loggers: Callable[[Any], Any],
    root: str | os.PathLike,
    *,
    callbacks: Callable[[Any], list[Any]] | None = None,
    module: Any = None,
    shuffle: bool = False,
    **options: Any,
) -> tuple[Any, Any]:
    """Fit the project under framework ``name`` with ``make_loggers(loggers_module)``; returns (trainer, module).

    ``module``: the project module to fit (made from seed 0 when None); ``shuffle``: shuffle the training data;
    ``options`` are further Trainer arguments (``strategy``, ``devices``, ``enable_checkpointing``, ...).
    """
    trainer_class, base, loggers_module = framework(name)
    if module is None:
        torch.manual_seed(0)
        module = project_class(base)()
    arguments: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=os.fspath(root),
    )
    arguments.update(options)
    if callbacks is not None:
        arguments["callbacks"] = callbacks(_callbacks_module(name))
    trainer = trainer_class(logger=make_loggers(loggers_module), **arguments)
    trainer.fit(module, *loaders(shuffle))
    return trainer, module


def _callbacks_module(name: str) -> Any:
    return importlib.import_module("pytorch_lightning.callbacks" if name == "lightning" else "phalanx.callbacks")


# ---------------------------------------------------------------------- readers
def tensorboard_scalars(folder: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``folder``: tag -> [(step, value)] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.fspath(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def tensorboard_hparams(folder: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """The HPARAMS entry of the event files in ``folder``: (hyperparameters, the metric tags it names)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(os.fspath(folder))
    accumulator.Reload()
    params: dict[str, Any] = {}
    metrics: list[str] = []
    try:
        contents = accumulator.PluginTagToContent("hparams").values()
    except KeyError:  # no HPARAMS entry at all
        return params, metrics
    for content in contents:
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                params[key] = getattr(value, value.WhichOneof("kind"))
        if data.HasField("experiment"):
            metrics += [info.name.tag for info in data.experiment.metric_infos]
    return params, metrics


def tensorboard_graph_ops(folder: str | os.PathLike) -> list[str]:
    """The sorted operation names of the graph in the event files of ``folder`` (empty without a graph)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.fspath(folder))
    accumulator.Reload()
    if not accumulator.Tags()["graph"]:
        return []
    return sorted(node.op for node in accumulator.Graph().node)


def mlflow_run(tracking_uri: str, run_id: str) -> dict[str, Any]:
    """What an MLflow store holds of a run, read with ``MlflowClient``: metrics (name -> [(step, value)]), params,
    status, tags, experiment name and artifact paths."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    metrics = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)]
        for key in run.data.metrics
    }
    return {
        "metrics": metrics,
        "params": dict(run.data.params),
        "status": run.info.status,
        "tags": dict(run.data.tags),
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "artifacts": sorted(_artifact_paths(client, run_id, None)),
    }


def _artifact_paths(client: Any, run_id: str, folder: str | None) -> list[str]:
    paths = []
    for entry in client.list_artifacts(run_id, folder):
        paths += _artifact_paths(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return paths


def wandb_records(save_dir: str | os.PathLike, run_id: str) -> list[dict[str, Any]]:
    """Every record of run ``run_id``'s ``.wandb`` files under ``save_dir``, read by wandb's own reader
    (``wandb leet inspect --json``), in the order written (a run resumed in another process has several files)."""
    files = sorted(Path(save_dir).glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))
    assert files, f"no .wandb file of run {run_id} under {save_dir}: {sorted(Path(save_dir).rglob('*'))}"
    records = []
    for path in files:
        job = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WANDB_SILENT": "true"},
        )
        assert job.returncode == 0, job.stderr
        records += [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    return records


def wandb_history(records: list[dict[str, Any]], step_key: str = "trainer/global_step") -> dict[str, list[tuple]]:
    """The metrics of history records: name -> [(``step_key``'s value, value)], wandb's own keys left out."""
    series: dict[str, list[tuple]] = {}
    for record in records:
        if record.get("type") != "history":
            continue
        item = record["history"]["item"]
        for key, value in item.items():
            if key.startswith("_") or key == step_key or not isinstance(value, (int, float)):
                continue
            series.setdefault(key, []).append((item.get(step_key), value))
    return series


def wandb_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's config as its records set it (wandb's own ``_wandb`` entry left out)."""
    config: dict[str, Any] = {}
    for record in records:
        update = None
        if record.get("type") == "run":
            update = record["run"].get("config", {}).get("update")
        elif record.get("type") == "config":
            update = record["config"].get("update")
        for key, value in (update or {}).items():
            if key != "_wandb":
                config[key] = value
    return config


def assert_same_series(ours: dict[str, list[tuple]], theirs: dict[str, list[tuple]], what: str) -> None:
    """The same names, and for each the same steps and (to float precision) the same values."""
    assert sorted(ours) == sorted(theirs), (
        f"{what}: metric names differ: phalanx {sorted(ours)}, Lightning {sorted(theirs)}"
    )
    for name in ours:
        steps = [point[0] for point in ours[name]], [point[0] for point in theirs[name]]
        assert steps[0] == steps[1], f"{what}: {name!r} at steps {steps[0]} (phalanx), {steps[1]} (Lightning)"
        for (step, mine), (_, other) in zip(ours[name], theirs[name]):
            assert math.isclose(mine, other, rel_tol=1e-5, abs_tol=1e-7), (
                f"{what}: {name!r} at {step}: {mine} != {other}"
            )
