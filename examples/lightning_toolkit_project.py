"""A Lightning project with its usual toolkit, run on phalanx with only its imports changed.

torchmetrics objects logged with ``self.log`` (accuracy per step and per epoch, computed over the epoch and synchronised
across processes by torchmetrics itself), an MLflow tracking store (an SQLite file; an ``http://`` server works the
same), a SimpleProfiler with a section of the user's own (``self.trainer.profiler.profile(...)``), a
ThroughputMonitor counting samples per second, StochasticWeightAveraging over the last epochs, and the learning-rate
finder choosing the rate before training. Synthetic data made in-process; nothing is downloaded.

Run: python examples/lightning_toolkit_project.py --strategy ddp --devices 2 [--accelerator cpu] [--max-epochs 3]
     [--root DIR]; then read the run with ``mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`` or MlflowClient.
"""

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

# The only lines that differ from the Lightning project. Lightning's were:
#   from lightning.pytorch import LightningModule, Trainer, seed_everything
#   from lightning.pytorch.callbacks import StochasticWeightAveraging, ThroughputMonitor
#   from lightning.pytorch.loggers import MLFlowLogger
#   from lightning.pytorch.profilers import SimpleProfiler
#   from lightning.pytorch.tuner import Tuner
from phalanx import Trainer, seed_everything
from phalanx import TrainingModule as LightningModule
from phalanx.callbacks import StochasticWeightAveraging, ThroughputMonitor
from phalanx.loggers import MLFlowLogger
from phalanx.profilers import SimpleProfiler
from phalanx.tuner import Tuner

CLASSES, FEATURES = 3, 8


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="auto", help="a count such as 2, or 'auto'")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--root", default=None, help="where logs, profiles and checkpoints go (default: a new folder)")
    args = parser.parse_args()
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    root = args.root or tempfile.mkdtemp(prefix="lightning_toolkit_project_")

    seed_everything(0)
    train, val, test = blobs(128, seed=0), blobs(64, seed=1), blobs(64, seed=2)
    trainer = Trainer(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=devices,
        max_epochs=args.max_epochs,
        log_every_n_steps=2,
        default_root_dir=root,
        logger=MLFlowLogger(experiment_name="toolkit", tracking_uri=f"sqlite:///{root}/mlflow.db"),
        profiler=SimpleProfiler(dirpath=root, filename="profile"),
        callbacks=[
            ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=4),
            # Weights averaged over the last epochs, at a constant learning rate reached after one annealing epoch.
            StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1),
        ],
    )
    model = Classifier()
    train_loader, val_loader = DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16)
    if trainer.world_size == 1:  # the finder runs in one process; with several, pick the rate on one first
        finder = Tuner(trainer).lr_find(model, train_loader, min_lr=1e-3, max_lr=1.0, num_training=16)
        print(f"learning rate found: {model.hparams.lr:.4g} (suggested {finder.suggestion():.4g})")
    trainer.fit(model, train_loader, val_loader)
    results = trainer.test(model, DataLoader(test, batch_size=16))
    if trainer.is_global_zero:
        print(f"MLflow run {trainer.logger.run_id} in sqlite:///{root}/mlflow.db; profile under {root}")
        print(f"test accuracy: {results[0]['test_acc']:.4f}")


if __name__ == "__main__":
    main()
