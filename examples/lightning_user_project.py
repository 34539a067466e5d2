"""A Lightning user's small project, run on phalanx with only its imports changed.

A DataModule of synthetic images (made in-process, nothing downloaded), a small CNN, OneCycleLR over
``self.trainer.estimated_stepping_batches`` stepped every optimizer step, ModelCheckpoint (top 2 by ``val_loss`` and
``last.ckpt``), EarlyStopping, LearningRateMonitor, TensorBoard and CSV logs, gradient accumulation and clipping,
bf16-mixed precision; then a test of the best checkpoint.

Run: python examples/lightning_user_project.py --strategy ddp --devices 2 [--accelerator cpu] [--max-epochs 3]
     [--root DIR] (strategies: auto, single_device, ddp, ddp_spawn, fsdp, deepspeed, ...)
"""

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# The only lines that differ from the Lightning project. Lightning's were:
#   from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
#   from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
#   from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from phalanx import DataModule as LightningDataModule
from phalanx import Trainer, seed_everything
from phalanx import TrainingModule as LightningModule
from phalanx.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from phalanx.loggers import CSVLogger, TensorBoardLogger


class ShapesDataModule(LightningDataModule):
    """Images of 3 classes: a bright square, a bright bar or a dark background, at random places, with noise."""

    def __init__(self, samples: int = 96, size: int = 12, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _make(self, count: int, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        size = self.hparams.size
        images = 0.3 * torch.randn(count, 1, size, size, generator=generator)
        labels = torch.randint(0, 3, (count,), generator=generator)
        corners = torch.randint(0, size - 4, (count, 2), generator=generator)
        for image, label, (row, col) in zip(images, labels.tolist(), corners.tolist()):
            if label == 0:
                image[0, row : row + 4, col : col + 4] += 1.0
            elif label == 1:
                image[0, row, :] += 1.0
        return TensorDataset(images, labels)

    def setup(self, stage: str) -> None:
        self.train_set = self._make(self.hparams.samples, seed=0)
        self.val_set = self._make(self.hparams.samples // 2, seed=1)
        self.test_set = self._make(self.hparams.samples // 2, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


class SmallCNN(LightningModule):
    def __init__(self, max_lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.max_lr / 25)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.max_lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="auto", help="a count such as 2, or 'auto'")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--root", default=None, help="where logs and checkpoints go (default: a new temporary folder)")
    args = parser.parse_args()
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    root = args.root or tempfile.mkdtemp(prefix="lightning_user_project_")

    seed_everything(0)
    datamodule = ShapesDataModule()
    model = SmallCNN()
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{val_loss:.3f}")
    trainer = Trainer(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=devices,
        max_epochs=args.max_epochs,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        log_every_n_steps=2,
        default_root_dir=root,
        logger=[TensorBoardLogger(root, name="tensorboard"), CSVLogger(root, name="csv")],
        callbacks=[
            checkpoint,
            EarlyStopping(monitor="val_loss", patience=5),
            LearningRateMonitor(logging_interval="step"),
        ],
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=datamodule)
    results = trainer.test(model, datamodule=datamodule, ckpt_path="best")
    if trainer.is_global_zero:
        print(f"best checkpoint: {checkpoint.best_model_path} (val_loss {float(checkpoint.best_model_score):.4f})")
        print(f"test accuracy: {results[0]['test_acc']:.3f}; logs and checkpoints under {root}")


if __name__ == "__main__":
    main()
