"""A Lightning project with its usual toolkit, run on phalanx with only its imports changed.

A command line (LightningCLI: the module's, the data's and the Trainer's arguments as options), torchmetrics objects
logged with ``self.log`` (accuracy per step and per epoch, computed over the epoch and synchronised across processes by
torchmetrics itself), an MLflow tracking store (an SQLite file; an ``http://`` server works the same), a SimpleProfiler
with a section of the user's own (``self.trainer.profiler.profile(...)``), a ThroughputMonitor counting samples per
second, StochasticWeightAveraging over the last epoch, and the learning-rate finder choosing the rate before training
(on one process). Synthetic data made in-process; nothing is downloaded. Logs, profiles and checkpoints go to
``toolkit_runs/`` under the working directory.

Run: python examples/lightning_toolkit_project.py --trainer.strategy ddp --trainer.devices 2 [--trainer.accelerator cpu]
     [--trainer.max_epochs 3] [--model.hidden 32] [--data.batch_size 16] (--help lists every option); then read the
     run with ``mlflow ui --backend-store-uri sqlite:///toolkit_runs/mlflow.db`` or MlflowClient.
"""

import os

import torch
import torch.nn.functional as F
from jsonargparse import lazy_instance
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

# The only lines that differ from the Lightning project. Lightning's were:
#   from lightning.pytorch import LightningDataModule, LightningModule
#   from lightning.pytorch.callbacks import StochasticWeightAveraging, ThroughputMonitor
#   from lightning.pytorch.cli import LightningCLI
#   from lightning.pytorch.loggers import MLFlowLogger
#   from lightning.pytorch.profilers import SimpleProfiler
#   from lightning.pytorch.tuner import Tuner
from phalanx import DataModule as LightningDataModule
from phalanx import TrainingModule as LightningModule
from phalanx.callbacks import StochasticWeightAveraging, ThroughputMonitor
from phalanx.cli import LightningCLI
from phalanx.loggers import MLFlowLogger
from phalanx.profilers import SimpleProfiler
from phalanx.tuner import Tuner

CLASSES, FEATURES = 3, 8
#: Where logs, profiles and checkpoints go, under the working directory.
ROOT = "toolkit_runs"


def blobs(count: int, seed: int) -> TensorDataset:
    """Points around one centre per class, with noise: a problem a small network learns in a few epochs."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(123)) * 2
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    points = centres[labels] + torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(points, labels)


class Classifier(LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.val_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.test_acc = MulticlassAccuracy(num_classes=CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        with self.trainer.profiler.profile("accuracy_update"):
            self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc.update(self.net(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class BlobsData(LightningDataModule):
    """Training, validation and test points (128, 64 and 64), made in-process."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train, self.val, self.test = blobs(128, seed=0), blobs(64, seed=1), blobs(64, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.hparams.batch_size)


def main() -> None:
    os.makedirs(ROOT, exist_ok=True)
    cli = LightningCLI(
        Classifier,
        BlobsData,
        run=False,
        seed_everything_default=0,
        # An MLflow run in an SQLite store has no log folder for the config file (Lightning's CLI then fails).
        save_config_callback=None,
        trainer_defaults={
            "max_epochs": 3,
            "log_every_n_steps": 2,
            "default_root_dir": ROOT,
            "logger": lazy_instance(
                MLFlowLogger, experiment_name="toolkit", tracking_uri=f"sqlite:///{ROOT}/mlflow.db"
            ),
            "profiler": lazy_instance(SimpleProfiler, dirpath=ROOT, filename="profile"),
            "callbacks": [
                ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=4),
                StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1),
            ],
        },
    )
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    if trainer.world_size == 1:
        finder = Tuner(trainer).lr_find(model, datamodule=data, min_lr=1e-3, max_lr=1.0, num_training=16)
        print(f"learning rate found: {model.hparams.lr:.4g} (suggested {finder.suggestion():.4g})")
    trainer.fit(model, datamodule=data)
    results = trainer.test(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"MLflow run {trainer.logger.run_id} in sqlite:///{ROOT}/mlflow.db; profile under {ROOT}")
        print(f"test accuracy: {results[0]['test_acc']:.4f}")


if __name__ == "__main__":
    main()
