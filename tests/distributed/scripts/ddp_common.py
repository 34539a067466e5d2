"""Models and data shared by the distributed job scripts (importable: the scripts' folder is on sys.path)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import phalanx


class IndexedRegression(Dataset):
    """A regression dataset whose samples carry their own index, so tests can see which rank read what."""

    def __init__(self, n: int = 50, features: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Net(phalanx.TrainingModule):
    def __init__(self, features: int = 4, lr: float = 0.05, batchnorm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(features, 16)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.ReLU(), nn.Linear(16, 1)]
        self.net = nn.Sequential(*layers)
        self.seen_train: list[int] = []
        self.seen_eval: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen_train += index.tolist()
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        self.seen_eval += index.tolist()
        self.log("val_loss", nn.functional.mse_loss(self(x), y, reduction="mean"), sync_dist=True)
        self.log("val_count", float(len(index)), reduce_fx="sum", sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def write_json(directory: str | Path, name: str, payload: Any) -> None:
    path = Path(directory) / name
    path.write_text(json.dumps(payload))


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
