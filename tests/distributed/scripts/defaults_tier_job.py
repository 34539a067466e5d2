"""The defaults tier (tests/distributed/test_defaults_tier.py): one strategy run as a new user runs it, every Trainer
argument left at its default but ``accelerator="cpu"``, ``devices`` and ``max_epochs``, in the working directory
(so the default CSV logger and checkpoint folder ``logs/version_N/checkpoints`` are used), progress bar on.

Usage: python defaults_tier_job.py STRATEGY OUT   (run with the working directory where the logs should go)

Stages, in order, on the Trainers A to E:
- A (max_epochs=2): validate, test, predict before fit; fit (with its sanity check); validate, test
  (``ckpt_path="best"``) and predict after it.
- B (max_epochs=3): a fresh Trainer and module, ``fit(ckpt_path="auto")`` continues A's run.
- C (max_epochs=4, the one non-default: ``callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)]``, still in
  the default folder): ``fit(ckpt_path="auto")`` continues B's run; then ``validate(ckpt_path="last")`` and
  ``test(ckpt_path="best")``.
- D (max_epochs=5, C's callback): ``fit(ckpt_path="last")``. E (max_epochs=5, C's callback): ``fit(ckpt_path="best")``.

Every process that calls the stages (both ranks under ddp, the main process under ddp_spawn/ddp_fork) writes
OUT/report_<pid>.json with what it sees after each stage; every rank's module appends its training losses, the
sanity-check steps and where each fit started and ended to OUT/events_rank<R>.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import ModelCheckpoint

TRAIN, VAL, TEST, PREDICT, BATCH = 64, 32, 32, 20, 8
#: Strategies run on one process; the others on two (ddp_ft: one replica group of one process).
ONE_PROCESS = {"single_device", "ddp_ft"}
#: Rows that pass no ``strategy=``: the default ('auto') picks it from ``devices``.
AUTO = {"single_device", "ddp"}


def regression(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]]))


def loader(n: int, seed: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(regression(n, seed), batch_size=BATCH, shuffle=shuffle)


class TierModule(phalanx.TrainingModule):
    """A small regression MLP that logs like a Lightning user's module and records what each rank ran."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def record(self, **event: Any) -> None:
        with open(Path(self.out) / f"events_rank{self.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(event) + "\n")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.record(event="train_loss", epoch=self.current_epoch, loss=loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if self.trainer.sanity_checking:
            self.record(event="sanity_step")
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def on_train_start(self) -> None:
        self.record(event="train_start", epoch=self.current_epoch, step=self.global_step)

    def on_train_end(self) -> None:
        self.record(event="train_end", epoch=self.current_epoch, step=self.global_step)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)


class TensorParallelTierModule(TierModule):
    """For model_parallel: parallelises itself as the README shows (tensor parallel, then fully_shard)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(self.net[0].weight, DTensor):
            return  # every stage calls configure_model; the module is parallelised once
        mesh = self.device_mesh
        parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(self.net, mesh=mesh["data_parallel"])


def trainer(name: str, max_epochs: int, **extra: Any) -> phalanx.Trainer:
    options: dict[str, Any] = {"accelerator": "cpu", "devices": 1 if name in ONE_PROCESS else 2}
    if name not in AUTO:
        options["strategy"] = name
    return phalanx.Trainer(max_epochs=max_epochs, **options, **extra)


def seen(trainer: phalanx.Trainer, stage: str, result: Any = None) -> dict[str, Any]:
    """What this process sees after ``stage``: the loggers' folder, the checkpoint callback's results, progress."""
    callback = trainer.checkpoint_callback
    score = callback.best_model_score
    folder = callback.dirpath
    return {
        "stage": stage,
        "log_dir": trainer.log_dir,
        "version": trainer.logger.version,
        "dirpath": folder,
        "files": sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else [],
        "best_model_path": callback.best_model_path,
        "best_model_score": None if score is None else float(score),
        "last_model_path": callback.last_model_path,
        "ckpt_path": trainer.ckpt_path,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "result": result,
    }


def predictions(outputs: Any) -> list[float]:
    values = torch.cat([batch.flatten() for batch in outputs]).tolist()
    assert all(math.isfinite(value) for value in values), values
    return values


def start_replica_group() -> Any:
    """For ddp_ft: a lighthouse in this process, and the environment of replica group 0 of 1 that strategy="ddp_ft"
    reads (as a user's launch command sets it)."""
    from datetime import timedelta

    from phalanx.strategies.fault_tolerant import start_lighthouse

    # One group: its quorum forms at once; a finished fit's group is forgotten within a second.
    times = {"join_timeout": timedelta(milliseconds=20), "quorum_tick": timedelta(milliseconds=10)}
    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout=timedelta(seconds=1), **times)
    os.environ.update(REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="1", TORCHFT_LIGHTHOUSE=lighthouse.address)
    return lighthouse


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    lighthouse = start_replica_group() if name == "ddp_ft" else None
    module_type = TensorParallelTierModule if name == "model_parallel" else TierModule
    phalanx.seed_everything(3)
    report: list[dict[str, Any]] = []
    model = module_type(out)
    a = trainer(name, max_epochs=2)
    report.append(seen(a, "validate_before_fit", a.validate(model, loader(VAL, 1))))
    report.append(seen(a, "test_before_fit", a.test(model, loader(TEST, 2))))
    report.append(seen(a, "predict_before_fit", predictions(a.predict(model, loader(PREDICT, 3)))))
    a.fit(model, loader(TRAIN, 0, shuffle=True), loader(VAL, 1))
    report.append(seen(a, "fit"))
    report.append(seen(a, "validate_after_fit", a.validate(model, loader(VAL, 1))))
    report.append(seen(a, "test_best_after_fit", a.test(model, loader(TEST, 2), ckpt_path="best")))
    report.append(seen(a, "predict_after_fit", predictions(a.predict(model, loader(PREDICT, 3)))))

    b = trainer(name, max_epochs=3)
    b.fit(module_type(out), loader(TRAIN, 0, shuffle=True), loader(VAL, 1), ckpt_path="auto")
    report.append(seen(b, "fit_auto"))

    c = trainer(name, max_epochs=4, callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)])
    model_c = module_type(out)
    c.fit(model_c, loader(TRAIN, 0, shuffle=True), loader(VAL, 1), ckpt_path="auto")
    report.append(seen(c, "fit_auto_save_last"))
    report.append(seen(c, "validate_last", c.validate(model_c, loader(VAL, 1), ckpt_path="last")))
    report.append(seen(c, "test_best", c.test(model_c, loader(TEST, 2), ckpt_path="best")))

    d = trainer(name, max_epochs=5, callbacks=[c.checkpoint_callback])
    d.fit(module_type(out), loader(TRAIN, 0, shuffle=True), loader(VAL, 1), ckpt_path="last")
    report.append(seen(d, "fit_last"))
    e = trainer(name, max_epochs=5, callbacks=[c.checkpoint_callback])
    e.fit(module_type(out), loader(TRAIN, 0, shuffle=True), loader(VAL, 1), ckpt_path="best")
    report.append(seen(e, "fit_best"))
    payload = {"global_rank": a.global_rank, "world_size": a.world_size, "stages": report}
    payload["strategy"] = type(a.strategy).__name__
    (Path(out) / f"report_{os.getpid()}.json").write_text(json.dumps(payload))
    if lighthouse is not None:
        lighthouse.shutdown()


if __name__ == "__main__":
    main()
