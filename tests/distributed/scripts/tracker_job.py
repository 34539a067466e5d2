"""The project of tests/tracker_parity.py fitted on two processes with TensorBoard, MLflow and W&B loggers at once.

Usage: python tracker_job.py FRAMEWORK STRATEGY OUT_DIR MLFLOW_URI, FRAMEWORK "phalanx" or "lightning", STRATEGY a
Trainer strategy (``ddp``, ``fsdp``, ``ddp_spawn``) or ``cohort_ddp_spawn`` (a phalanx Cohort loop). W&B runs offline
(the test sets WANDB_MODE and every wandb folder). Every rank writes ``rank<N>.json`` at the end of its stage: the
versions its loggers name (TensorBoard version, MLflow run id, W&B run id) and its checkpoint folder; the launching
process writes ``main.json``: its loggers' versions after the stage and, under ``ddp_spawn``, after they wrote
one more metric in this process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tracker_parity import fit, loaders

import phalanx
from phalanx.callbacks import Callback


def _versions(loggers: list[Any]) -> list[str]:
    return [str(logger.version) for logger in loggers]


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    (out / name).write_text(json.dumps(record))


def _record_fit_end(out: str, trainer: Any) -> None:
    """On every rank at the end of fit: what the loggers and the checkpoint callback name."""
    record = {"versions": _versions(trainer.loggers), "checkpoints": trainer.checkpoint_callback.dirpath}
    _write(Path(out), f"rank{trainer.global_rank}.json", record)


class PhalanxRecorder(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        _record_fit_end(self.out, trainer)


def _recorders(framework: str, out: Path) -> Any:
    if framework == "phalanx":
        return lambda callbacks: [PhalanxRecorder(str(out))]
    import pytorch_lightning as pl

    class LightningRecorder(pl.Callback):
        def on_fit_end(self, trainer: Any, module: Any) -> None:
            _record_fit_end(str(out), trainer)

    return lambda callbacks: [LightningRecorder()]


def _loggers(loggers: Any, framework: str, strategy: str, out: Path, uri: str) -> list[Any]:
    return [
        loggers.TensorBoardLogger(save_dir=str(out / "tb"), name="tb"),
        loggers.MLFlowLogger(experiment_name=f"{framework}-{strategy}", tracking_uri=uri),
        loggers.WandbLogger(project="dist", save_dir=str(out / "wandb"), offline=True),
    ]


def _cohort_loop(cohort: phalanx.Cohort, out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = cohort.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (x, y) in enumerate(cohort.setup_dataloaders(loaders()[0])):
        loss = torch.nn.functional.mse_loss(model(x), y)
        cohort.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        cohort.log("loss", cohort.all_reduce(loss.detach(), reduce_op="mean"), step=step)
    _write(Path(out), f"rank{cohort.global_rank}.json", {"versions": _versions(cohort.loggers)})


def main() -> None:
    framework, strategy, out, uri = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    loggers_module = __import__(
        "phalanx.loggers" if framework == "phalanx" else "pytorch_lightning.loggers", fromlist=["x"]
    )
    if strategy.startswith("cohort_"):
        cohort = phalanx.Cohort(
            accelerator="cpu",
            strategy=strategy.removeprefix("cohort_"),
            devices=2,
            loggers=_loggers(loggers_module, framework, strategy, out, uri),
        )
        cohort.launch(_cohort_loop, str(out))
        _write(out, "main.json", {"versions": _versions(cohort.loggers)})
        return
    trainer, module = fit(
        framework,
        lambda loggers: _loggers(loggers, framework, strategy, out, uri),
        out / "root",
        strategy=strategy,
        devices=2,
        enable_checkpointing=True,
        callbacks=_recorders(framework, out),
        shuffle=True,  # an unshuffled loader Lightning shuffles on several processes, phalanx does not
    )
    if trainer.global_rank != 0:
        return
    record: dict[str, Any] = {"versions": _versions(trainer.loggers)}
    if strategy == "ddp_spawn":  # this process's loggers write to the runs the workers wrote to
        for logger in trainer.loggers:
            logger.log_metrics({"in_main_process": 1.0}, step=100)
        record["after_writing"] = _versions(trainer.loggers)
    _write(out, "main.json", record)
    import wandb

    if wandb.run is not None:
        wandb.finish()


if __name__ == "__main__":
    os.environ.setdefault("WANDB_SILENT", "true")
    main()
