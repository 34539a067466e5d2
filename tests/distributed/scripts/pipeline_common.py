"""The model, data and cases shared by the pipeline job (2 processes, ``pipeline_job.py``) and the test that runs the
same cases on one process (``tests/distributed/test_pipeline_processes.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies.pipeline_split import keep_stages

#: name -> (schedule, Trainer options beside the quiet ones); "defaults" leaves the Trainer's defaults on.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "defaults_1F1B": ("1F1B", {"max_epochs": 1, "limit_val_batches": 2}),
    "GPipe_clip_accumulate": (
        "GPipe",
        {"max_steps": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
    ),
    # Two virtual stages per rank: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (one block each).
    "Interleaved1F1B": ("Interleaved1F1B", {"max_epochs": 1, "limit_val_batches": 1}),
    # The other virtual-stage schedules, two batches each; ZBVZeroBubble and DualPipeV place the stages in a V.
    **{
        schedule: (schedule, {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1})
        for schedule in ("LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    },
    # bfloat16 autocast around the schedule: one process's losses within bfloat16's precision (micro-batches round
    # differently from the whole batch).
    "bf16_1F1B": (
        "1F1B",
        {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1, "precision": "bf16-mixed"},
    ),
}
#: How close each case comes to one process (relative); float32 cases: 1e-5.
TOLERANCE = {"bf16_1F1B": 2e-2}
#: pp=2 composed with dp=2 or tp=2 on 4 processes (``parallel_dims_job.py``): one epoch of 4 batches of 8 samples,
#: clipped by norm at every step (one norm over every stage and shard).
COMPOSED = {"max_epochs": 1, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))


def loader(batch_size: int = 8) -> DataLoader:
    return DataLoader(data(), batch_size=batch_size)


class Block(nn.Module):
    """A residual block (a transformer layer's shape, tiny)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(phalanx.TrainingModule):
    """Embedding, four blocks and a head; under a pipeline each rank keeps its stage's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(4))
        self.head: nn.Module | None = nn.Linear(8, 1)
        self.losses: list[float] = []
        self.validation_losses: list[list[Any]] = []
        #: [hook, the loss it received, the squared norm of this rank's gradients then (None: none yet)] per call.
        self.hooks: list[list[Any]] | None = []

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if getattr(strategy, "pipeline_parallel_size", 1) > 1:
            stages = strategy.pipeline_stages
            keep_stages(self, "blocks", stages, strategy.num_pipeline_stages, first=["embed"], last=["head"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def pipeline_input(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # What one process runs; under a pipeline the strategy runs the two hooks above instead.
        return self.pipeline_loss(self(self.pipeline_input(batch)), batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss.detach(), prog_bar=True)

    def _record(self, hook: str, loss: torch.Tensor | None = None) -> None:
        if self.hooks is not None:
            grads = [p.grad.double() for p in self.parameters() if p.grad is not None]
            squared = float(sum((grad**2).sum() for grad in grads)) if grads else None
            self.hooks.append([hook, None if loss is None else float(loss.detach()), squared])

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._record("on_before_backward", loss)

    def on_after_backward(self) -> None:
        self._record("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._record("on_before_optimizer_step")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        # [whether the sanity check runs, the loss]: the sanity check's outputs are logged nowhere else.
        self.validation_losses.append([self.trainer.sanity_checking, float(loss)])
        self.log("val_loss", loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_case(name: str, strategy: Any, devices: int, root: str) -> tuple[phalanx.Trainer, Net]:
    """Fit ``Net`` (seeded) under case ``name``'s options."""
    _, options = CASES[name]
    options = {**(QUIET if not name.startswith("defaults") else {}), **options}
    phalanx.seed_everything(1)
    module = Net()
    trainer = phalanx.Trainer(accelerator="cpu", devices=devices, strategy=strategy, default_root_dir=root, **options)
    trainer.fit(module, loader(), loader())
    return trainer, module


class AdamNet(Net):
    """``Net`` with an optimizer that keeps a state per parameter (what a resumed run must get back exactly)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_for_checkpoint(strategy: Any, devices: int, root: str, epochs: int, ckpt_path: str | None = None) -> Any:
    """Fit ``AdamNet`` (seeded) for ``epochs`` epochs of two batches, from ``ckpt_path`` if given."""
    phalanx.seed_everything(1)
    module = AdamNet()
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, default_root_dir=root, max_epochs=epochs, **QUIET
    )
    trainer.fit(module, loader(16), ckpt_path=ckpt_path)
    return trainer, module
