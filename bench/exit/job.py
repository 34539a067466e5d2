"""A short phalanx DDP job on 2 CPU processes, the unit of bench/bench_exit_aborts.py (the pattern of
tests/distributed/scripts/tiny_fit.py: 4 steps that end at an epoch end, an epoch-level synced metric, results read
on every rank afterwards).

Usage: python bench/exit/job.py drain|no-drain   (phalanx starts the second process itself, with the same argument;
under torchrun each worker runs it). "no-drain" turns off the pause phalanx takes at exit before destroying the
process group, to show what the pause prevents.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
from phalanx.utilities import process_group_exit


class Indexed(Dataset):
    def __init__(self, n: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen += index.tolist()
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("drain", "no-drain"):
        sys.exit(f"usage: {sys.argv[0]} drain|no-drain")
    if sys.argv[1] == "no-drain":
        process_group_exit.WORKER_DRAIN_SECONDS = 0.0
    phalanx.seed_everything(5)
    module = Regressor()
    trainer = phalanx.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(Indexed(), batch_size=4, shuffle=True))
    weights = [p.detach().flatten().tolist() for p in module.parameters()]
    print(
        f"rank {trainer.global_rank}: step {trainer.global_step}, {len(module.seen)} samples, {sum(map(len, weights))}"
        " weights"
    )
