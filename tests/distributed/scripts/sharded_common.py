"""Models and data shared by the sharded-strategy job (FSDP, ModelParallel) and by the tests that check its results."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

STEPS = 20
SINGLE_BATCH = 16  # one process: 16 samples a step; two processes: 8 each, the same 16 samples


def regression(n: int = 640, features: int = 8, seed: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    return TensorDataset(x, y)


def loader(world_size: int) -> DataLoader:
    # No shuffling: a DistributedSampler deals index i to rank i % 2, so two ranks' batches of 8 are one batch of 16.
    return DataLoader(regression(), batch_size=SINGLE_BATCH // world_size, shuffle=False)


class Block(nn.Module):
    """Linear + GELU; counts its forward calls (activation checkpointing runs them twice)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return nn.functional.gelu(self.linear(x))


class MLP(phalanx.TrainingModule):
    """Input layer, ``depth`` blocks, output layer; Adam; records its per-step training loss."""

    def __init__(
        self, width: int = 32, depth: int = 2, lr: float = 0.01, build_in_configure_model: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.losses: list[float] = []
        if not build_in_configure_model:
            self._build()

    def _build(self) -> None:
        width = self.hparams.width
        self.inp = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(self.hparams.depth)])
        self.out = nn.Linear(width, 1)

    def configure_model(self) -> None:
        if self.hparams.build_in_configure_model and not hasattr(self, "inp"):
            with self.trainer.strategy.tensor_init_context(empty_init=True):
                self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(torch.relu(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]).float()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class TransformerBlock(phalanx.TrainingModule):
    """Pre-norm self-attention + MLP; ``configure_model`` applies tensor parallelism when a mesh is there."""

    def __init__(self, dim: int = 32, heads: int = 4, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, 1)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
        }
        parallelize_module(self, mesh["tensor_parallel"], plan)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, length, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        x = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return self.head(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        # SGD: Adam would blow the float noise in the (gradient-free) key bias up into visible differences.
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def sequences(n: int = 64, length: int = 6, dim: int = 32, seed: int = 5) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, dim, generator=generator)
    return TensorDataset(x, x[..., :4].sum(-1))


def quiet(**kwargs: Any) -> phalanx.Trainer:
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return phalanx.Trainer(**options)
