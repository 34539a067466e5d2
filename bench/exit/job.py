"""A short phalanx DDP job on 2 CPU processes, the unit of bench/bench_exit_aborts.py.

Usage: python bench/exit/job.py drain|no-drain   (phalanx starts the second process itself, with the same argument)
"no-drain" turns off the pause phalanx takes at exit before destroying the process group, to show what it prevents.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.utilities import process_group_exit


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    if sys.argv[1] not in ("drain", "no-drain"):
        sys.exit(f"usage: {sys.argv[0]} drain|no-drain")
    if sys.argv[1] == "no-drain":
        process_group_exit.WORKER_DRAIN_SECONDS = 0.0
    phalanx.seed_everything(0)
    dataset = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = phalanx.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=4, logger=False,
                              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Regressor(), DataLoader(dataset, batch_size=4, shuffle=True))
