"""A complete, runnable phalanx example: fit, validate, test and predict a small regressor, then resume from `last`.

Run: python examples/train_regressor.py [--precision bf16-mixed] [--max-epochs 5]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint


class Regressor(phalanx.TrainingModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
        return {"optimizer": optimizer, "lr_scheduler": scheduler, "monitor": "val_loss"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-epochs", type=int, default=5)
    args = parser.parse_args()

    phalanx.seed_everything(0)
    x = torch.randn(2048, 8)
    y = (x * torch.linspace(-1, 1, 8)).sum(dim=1, keepdim=True) + 0.05 * torch.randn(2048, 1)
    train, val, test = random_split(TensorDataset(x, y), [1536, 256, 256], generator=torch.Generator().manual_seed(0))
    root = tempfile.mkdtemp(prefix="phalanx_example_")
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    trainer = phalanx.Trainer(
        max_epochs=args.max_epochs, precision=args.precision, default_root_dir=root,
        callbacks=[checkpoint, EarlyStopping(monitor="val_loss", patience=3)],
    )  # fmt: skip
    model = Regressor()
    trainer.fit(model, DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256))
    print("best checkpoint:", checkpoint.best_model_path)
    trainer.test(model, DataLoader(test, batch_size=256))
    predictions = trainer.predict(model, DataLoader(test, batch_size=256))
    print("first predictions:", predictions[0][:3].flatten().tolist())
    resumed = phalanx.Trainer(
        max_epochs=args.max_epochs + 2,
        default_root_dir=root,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True, dirpath=checkpoint.dirpath)],
    )
    resumed.fit(
        Regressor(), DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256), ckpt_path="last"
    )
    print(f"resumed from last.ckpt and trained to epoch {resumed.current_epoch}")


if __name__ == "__main__":
    main()
