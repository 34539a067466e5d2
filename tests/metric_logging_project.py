"""A Lightning user's module that logs torchmetrics objects, run with the same code under Lightning 2.6 and phalanx,
and what a run leaves behind: the CSV logger's points and the Trainer's metric dictionaries.

Used in-process by tests/unit/trainer/logging/test_metric_objects.py (one device) and as a script by
tests/distributed/test_metric_objects_processes.py: ``python metric_logging_project.py FRAMEWORK STRATEGY DEVICES CASE
ROOT`` writes ROOT/summary.json from the process that called fit on global rank 0 (the main process under a spawn
launcher); ``python metric_logging_project.py cohort ddp 2 cohort ROOT`` runs the Cohort loop of run_cohort instead.

The metrics score predictions that are part of the data, not the model's outputs: every framework and strategy must
log the same numbers, and each epoch value can be checked against torchmetrics over the whole epoch's data.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TRAIN, VAL, TEST, BATCH, EPOCHS = 44, 28, 20, 8, 2
CLASSES = 3

# What each case logs, per hook: (what, name, options). "f1", "acc", "mean", "sum": forward the Metric on the batch,
# then self.log(name, metric); "collection": forward a MetricCollection, then self.log_dict(collection); "f1_update"
# and "sum_update": update() only (no forward value; options None: not logged; under ddp_spawn an update in place is
# what would land in memory the processes share); "f1_again": log the f1 Metric already updated under another name.
# In the "*_epoch_end" hooks the Metric is logged as it is, Lightning's documented pattern.
CASES: dict[str, dict[str, list[tuple[str, str, dict[str, Any]]]]] = {
    "train_step": {"train": [("f1", "train_f1", {}), ("acc", "train_acc", {"prog_bar": True})]},
    "train_epoch": {"train": [("f1", "train_f1", {"on_step": False, "on_epoch": True})]},
    "train_both": {"train": [("f1", "train_f1", {"on_step": True, "on_epoch": True, "prog_bar": True})]},
    "train_epoch_end": {"train": [("f1", "train_f1_step", {})], "train_epoch_end": [("f1", "train_f1_epoch", {})]},
    "val_epoch": {"val": [("f1", "val_f1", {"prog_bar": True}), ("mean", "val_mean", {"sync_dist": True})]},
    "val_both": {"val": [("f1", "val_f1", {"on_step": True, "on_epoch": True}), ("acc", "val_acc", {})]},
    "val_two_loaders": {"val": [("f1", "val_f1", {}), ("acc", "val_acc", {"on_step": True})]},
    "collections": {
        "train": [("collection", "", {"on_step": True, "on_epoch": True})],
        "val": [("collection", "", {})],
        "test": [("collection", "", {})],
    },
    "two_names": {"val": [("f1", "val_f1", {}), ("f1_again", "val_f1_copy", {"prog_bar": True})]},
    "update_only": {"train": [("f1_update", "train_f1", {"on_step": True, "on_epoch": True})]},
    "val_epoch_end": {"val": [("f1_update", "unlogged", None)], "val_epoch_end": [("f1", "val_f1", {})]},
    "test": {"test": [("f1", "test_f1", {}), ("acc", "test_acc", {"on_step": True, "on_epoch": True})]},
    # Under a Cohort (run_cohort): each self.log writes the Metric's compute() so far.
    "cohort": {"train": [("f1", "train_f1", {}), ("sum", "train_sum", {}), ("collection", "", {})]},
    # The processes' case: most of the above at once.
    "distributed": {
        "train": [
            ("f1", "train_f1", {"on_step": True, "on_epoch": True}),
            ("sum_update", "train_sum", {"on_step": False, "on_epoch": True}),
        ],
        "val": [
            ("f1", "val_f1", {"prog_bar": True}),
            ("mean", "val_mean", {"sync_dist": True}),
            ("sum_update", "val_sum", {}),
            ("collection", "", {}),
        ],
        "test": [("f1", "test_f1", {}), ("acc", "test_acc", {"on_step": True, "on_epoch": True})],
    },
}
#: Cases validated on two dataloaders; the others on one.
TWO_LOADERS = {"val_two_loaders", "collections", "distributed"}
STAGES = ("train", "val", "test")


def _data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    target = (torch.rand(n, generator=generator) < 0.5).long()
    # Scores that agree with the target most of the time, so F1 and accuracy are neither 0 nor 1.
    score = (0.35 * target + 0.65 * torch.rand(n, generator=generator)).clamp(0, 1)
    classes = torch.randint(0, CLASSES, (n,), generator=generator)
    logits = torch.randn(n, CLASSES, generator=generator) + 1.2 * nn.functional.one_hot(classes, CLASSES)
    return TensorDataset(x, y, score, target, logits, classes)


def train_data() -> TensorDataset:
    return _data(TRAIN, 0)


def val_data(index: int) -> TensorDataset:
    return _data(VAL, 1 + index)


def testing_data() -> TensorDataset:
    return _data(TEST, 9)


def _bundle(prefix: str) -> nn.ModuleDict:
    # Lazy: the module is built only where torchmetrics is installed (the tests skip otherwise).
    from torchmetrics import MeanMetric, MetricCollection, SumMetric
    from torchmetrics.classification import BinaryF1Score, MulticlassAccuracy, MulticlassF1Score

    collection = MetricCollection(
        [MulticlassAccuracy(num_classes=CLASSES), MulticlassF1Score(num_classes=CLASSES)], prefix=prefix
    )
    return nn.ModuleDict(
        {
            "f1": BinaryF1Score(),
            "acc": MulticlassAccuracy(num_classes=CLASSES),
            "mean": MeanMetric(),
            "sum": SumMetric(),
            "collection": collection,
        }
    )


def _inputs(what: str, batch: Any) -> tuple[Any, ...]:
    _, _, score, target, logits, classes = batch
    what = what.removesuffix("_update")
    if what in ("acc", "collection"):
        return logits, classes
    if what in ("mean", "sum"):
        return (score,)
    return score, target


class MetricLoggingBody:
    """The user's module, framework-free: module_class() puts it on LightningModule or TrainingModule."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.layer = nn.Linear(4, 1)
        # One bundle of Metrics per stage and dataloader, all attributes of the module, as Lightning requires.
        self.metrics = nn.ModuleDict(
            {f"{stage}_metrics": nn.ModuleList([_bundle(f"{stage}_") for _ in range(2)]) for stage in STAGES}
        )

    def _log(self, stage: str, batch: Any = None, dataloader_idx: int = 0) -> None:
        bundle = self.metrics[f"{stage.removesuffix('_epoch_end')}_metrics"][dataloader_idx]
        for what, name, options in CASES[self.case].get(stage, []):
            metric = bundle[what.removesuffix("_update").removesuffix("_again")]
            if batch is not None and what.endswith("_update"):
                metric.update(*_inputs(what, batch))
            elif batch is not None and not what.endswith("_again"):
                metric(*_inputs(what, batch))
            if options is None:
                continue
            if what == "collection":
                self.log_dict(metric, **options)
            else:
                self.log(name, metric, **options)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._log("train", batch)
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log("val", batch, dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log("test", batch, dataloader_idx)

    def on_train_epoch_end(self) -> None:
        self._log("train_epoch_end")

    def on_validation_epoch_end(self) -> None:
        self._log("val_epoch_end")

    def configure_model(self) -> None:
        # Under model_parallel (2 processes: tensor parallel 2) the layer is split across them; elsewhere a no-op.
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        if not isinstance(self.layer.weight, DTensor):
            parallelize_module(self.layer, mesh["tensor_parallel"], RowwiseParallel(input_layouts=Replicate()))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


_CLASSES = {"lightning": "LightningMetricLogging", "phalanx": "PhalanxMetricLogging"}


def module_class(framework: str) -> type:
    """The user's module on ``framework``'s base class, a module-level name of this file (spawned processes unpickle
    it by that name)."""
    name = _CLASSES[framework]
    if name not in globals():
        globals()[name] = type(name, (MetricLoggingBody, framework_parts(framework)[0]), {"__module__": __name__})
    return globals()[name]


def __getattr__(name: str) -> type:
    # A spawned process unpickling the module finds its class here before anything built it.
    for framework, class_name in _CLASSES.items():
        if name == class_name:
            return module_class(framework)
    raise AttributeError(name)


def framework_parts(framework: str) -> tuple[type, type, type]:
    """(module base class, Trainer, CSVLogger) of ``framework``."""
    if framework == "lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.loggers import CSVLogger as LightningCSV

        return pl.LightningModule, pl.Trainer, LightningCSV
    import phalanx
    from phalanx.loggers import CSVLogger

    return phalanx.TrainingModule, phalanx.Trainer, CSVLogger


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}


def csv_points(root: Path) -> list[tuple[str, int, float]]:
    """Every (name, step, value) the CSV logger wrote under ``root``, sorted."""
    (path,) = root.glob("**/metrics.csv")
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return sorted(
        (name, int(row["step"]), float(value))
        for row in rows
        for name, value in row.items()
        if value and name != "step"
    )


def run(
    framework: str, case: str, root: Path, strategy: str = "auto", devices: int = 1, defaults: bool = False
) -> dict:
    """Fit (two epochs, validating after each) and test the case's module; what the run leaves, as plain values.

    ``defaults``: the Trainer's defaults (sanity check, progress bar, checkpointing, model summary) stay on; the CSV
    logger is phalanx's default one and given to Lightning (whose default is TensorBoard).
    """
    _, trainer_class, csv_logger = framework_parts(framework)
    torch.manual_seed(0)
    model = module_class(framework)(case)
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        default_root_dir=root,
        log_every_n_steps=1,
    )
    if framework == "lightning" or not defaults:
        options["logger"] = csv_logger(root, name="csv")
    if not defaults:
        options.update(
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0
        )
    trainer = trainer_class(**options)
    val = [DataLoader(val_data(index), batch_size=BATCH) for index in range(2 if case in TWO_LOADERS else 1)]
    # Lightning shuffles the training data under a distributed sampler even when the loader does not; phalanx keeps
    # the loader's choice: with several processes both shuffle (DistributedSampler, seed 0), on one neither does.
    train = DataLoader(train_data(), batch_size=BATCH, shuffle=devices > 1)
    trainer.fit(model, train, val if len(val) > 1 else val[0])
    after_fit = {
        "callback": _floats(trainer.callback_metrics),
        "logged": _floats(trainer.logged_metrics),
        "progress_bar": _floats(trainer.progress_bar_metrics),
        # Lightning resets every Metric it logged when its epoch or stage ends.
        "updated": sorted(name for name, sub in model.named_modules() if getattr(sub, "_update_count", 0)),
    }
    test = trainer.test(model, DataLoader(testing_data(), batch_size=BATCH), verbose=False)
    return {
        "fit": after_fit,
        "test": [_floats(results) for results in test],
        "test_callback": _floats(trainer.callback_metrics),
        "global_rank": trainer.global_rank,
        "points": csv_points(root) if trainer.global_rank == 0 else None,
    }


def run_cohort(root: Path) -> dict:
    """The "cohort" case's training_step in a Cohort loop on 2 processes (ddp), then the loop's own cohort.log of the
    Metric and log_dict of the MetricCollection; what global rank 0's CSV logger wrote."""
    import phalanx
    from phalanx.loggers import CSVLogger

    cohort = phalanx.Cohort(accelerator="cpu", strategy="ddp", devices=2, loggers=CSVLogger(root, name="csv"))
    cohort.launch()
    module = module_class("phalanx")("cohort")
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05))
    for index, batch in enumerate(cohort.setup_dataloaders(DataLoader(train_data(), batch_size=BATCH))):
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    bundle = module.metrics["train_metrics"][0]
    cohort.log("epoch_f1", bundle["f1"])
    cohort.log_dict(bundle["collection"])
    for logger in cohort.loggers:
        logger.finalize("success")
    return {"global_rank": cohort.global_rank, "points": csv_points(root) if cohort.is_global_zero else None}


if __name__ == "__main__":
    framework, strategy, devices, case, out = sys.argv[1:]
    if framework == "cohort":
        summary = run_cohort(Path(out))
    else:
        summary = run(framework, case, Path(out), strategy=strategy, devices=int(devices))
    if summary["global_rank"] == 0:
        (Path(out) / "summary.json").write_text(json.dumps(summary))
