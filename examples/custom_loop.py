"""Your own training loop on any phalanx strategy, with phalanx.Cohort.

python examples/custom_loop.py --strategy ddp --devices 2
python examples/custom_loop.py --strategy fsdp --devices 2 --ckpt last.ckpt
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


def train(cohort: phalanx.Cohort, epochs: int, ckpt: str | None) -> float:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    with cohort.init_module():
        module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    loader = cohort.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True))
    loss = torch.zeros(())
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            cohort.backward(loss)
            cohort.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
        mean_loss = cohort.all_reduce(loss.detach())
        cohort.print(f"epoch {epoch}: loss {mean_loss.item():.4f} (world size {cohort.world_size})")
    if ckpt:
        # The Trainer's checkpoint format: Trainer.fit(ckpt_path=...) resumes it, cohort.load reads it back.
        cohort.save(ckpt, {"model": model, "optimizer": optimizer, "epoch": epochs})
    return float(mean_loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="1")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--ckpt", default=None, help="where to save the final checkpoint")
    args = parser.parse_args()
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    cohort = phalanx.Cohort(
        accelerator=args.accelerator, strategy=args.strategy, devices=devices, precision=args.precision
    )
    final = cohort.launch(
        train, args.epochs, args.ckpt
    )  # ddp re-runs this script per rank; ddp_spawn/fork start processes
    cohort.print(f"final loss {final:.4f}")


if __name__ == "__main__":
    main()
