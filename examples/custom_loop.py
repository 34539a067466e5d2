"""Your own training loop on any phalanx strategy, with phalanx.Cohort.

python examples/custom_loop.py --strategy ddp --devices 2
python examples/custom_loop.py --strategy fsdp --devices 2 --ckpt last.ckpt
python examples/custom_loop.py --strategy deepspeed_stage_3 --devices 2 --accumulate 2 --logs logs --max-norm 0
(DeepSpeed clips inside its engine, with its config's 'gradient_clipping': --max-norm 0 turns cohort.clip_gradients off)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


def train(cohort: phalanx.Cohort, epochs: int, ckpt: str | None, accumulate: int, max_norm: float) -> float:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    with cohort.init_module():
        module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    loader = cohort.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True))
    loss = torch.zeros(())
    for epoch in range(epochs):
        for index, (x, y) in enumerate(loader):
            # Gradient accumulation: micro-batches that do not end a window skip the gradient reduction (and, under
            # DeepSpeed, tell the engine that the window goes on).
            window_ends = (index + 1) % accumulate == 0 or index + 1 == len(loader)
            with cohort.no_backward_sync(model, enabled=not window_ends):
                loss = nn.functional.mse_loss(model(x), y)
                cohort.backward(loss / accumulate)
            if window_ends:
                if max_norm:
                    cohort.clip_gradients(model, optimizer, max_norm=max_norm)
                optimizer.step()
                optimizer.zero_grad()
        mean_loss = cohort.all_reduce(loss.detach())
        cohort.log("train_loss", mean_loss)  # at cohort.global_step, written by rank zero (with --logs)
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
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--logs", default=None, help="write metrics to LOGS/custom_loop/version_N/metrics.csv")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this norm (0: no clipping)")
    args = parser.parse_args()
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    loggers = phalanx.loggers.CSVLogger(save_dir=args.logs, name="custom_loop") if args.logs else None
    cohort = phalanx.Cohort(
        accelerator=args.accelerator, strategy=args.strategy, devices=devices, precision=args.precision, loggers=loggers
    )
    # ddp re-runs this script per rank; ddp_spawn/fork start processes. The loggers are finalized when train returns.
    final = cohort.launch(train, args.epochs, args.ckpt, args.accumulate, args.max_norm)
    cohort.print(f"final loss {final:.4f}")


if __name__ == "__main__":
    main()
