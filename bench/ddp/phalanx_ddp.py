"""phalanx DDP training on 2 CPU processes, the measured side of bench/bench_ddp.py; rank 0 saves its final weights.

Usage: python bench/ddp/phalanx_ddp.py OUT.pt STEPS   (phalanx starts the second process itself)
"""

import sys

import torch

torch.set_num_threads(1)

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402

BATCH = 64


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    phalanx.seed_everything(0)
    module = Regressor()
    generator = torch.Generator().manual_seed(0)
    n = 2 * BATCH * steps
    dataset = TensorDataset(torch.randn(n, 32, generator=generator), torch.randn(n, 1, generator=generator))
    trainer = phalanx.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH, shuffle=True))
    if trainer.is_global_zero:
        torch.save([p.detach() for p in module.model.parameters()], out)
