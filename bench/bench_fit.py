"""phalanx's fit time against a hand-written PyTorch loop: same model, data, optimizer and number of steps.

MLP 32->64->1, batch 64, 3000 SGD steps (10 epochs of 300 batches), one thread, no logger, checkpoint or progress
bar. Both run in this process, alternating (the order flips every pair), and the best of several repeats is compared
(the least disturbed run), beside the median of the pairs' ratios.
Each run is timed twice: wall-clock time and this process's CPU time. On a machine shared with other jobs the CPU
time is the steadier figure (it leaves out the time the process waits for a core; one thread, no device to wait for).
Usage: python bench/bench_fit.py [--repeats 5] [--steps 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

BATCH = 64
BATCHES_PER_EPOCH = 300


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * BATCHES_PER_EPOCH, 32, generator=generator)
    y = torch.randn(BATCH * BATCHES_PER_EPOCH, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


class Regressor(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock:
    """Wall-clock and process CPU time since construction."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def raw_loop(steps: int) -> tuple[tuple[float, float], nn.Module]:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = make_loader()
    clock = Clock()
    step = 0
    while step < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == steps:
                break
    return clock.read(), model


def phalanx_fit(steps: int) -> tuple[tuple[float, float], nn.Module]:
    torch.manual_seed(0)
    module = Regressor()
    loader = make_loader()
    trainer = phalanx.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    clock = Clock()
    trainer.fit(module, loader)
    return clock.read(), module.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    raw_loop(300)  # warm up allocator and kernels for both
    phalanx_fit(300)
    raw_times, phalanx_times = [], []
    for repeat in range(args.repeats):
        # The order alternates (loop first, then phalanx first) so that a drift in the machine's speed during a
        # pair favours neither side over the whole run.
        if repeat % 2 == 0:
            raw_time, raw_model = raw_loop(args.steps)
            fit_time, fit_model = phalanx_fit(args.steps)
        else:
            fit_time, fit_model = phalanx_fit(args.steps)
            raw_time, raw_model = raw_loop(args.steps)
        raw_times.append(raw_time)
        phalanx_times.append(fit_time)
    same = all(torch.equal(a, b) for a, b in zip(raw_model.parameters(), fit_model.parameters()))
    print(f"steps={args.steps} repeats={args.repeats} torch={torch.__version__} threads=1")
    print(f"identical final weights: {same}")
    for index, kind in enumerate(("wall", "cpu")):
        raw = [times[index] for times in raw_times]
        fit = [times[index] for times in phalanx_times]
        for name, runs in (("raw loop   ", raw), ("phalanx fit", fit)):
            print(
                f"{kind:4} {name}  best {min(runs):.3f} s  median {statistics.median(runs):.3f} s "
                f" ({min(runs) / args.steps * 1e6:.1f} us/step)"
            )
        pairs = statistics.median(f / r for f, r in zip(fit, raw))
        print(
            f"{kind:4} ratio (best/best): {min(fit) / min(raw):.3f}   (median/median:"
            f" {statistics.median(fit) / statistics.median(raw):.3f}; median of the pairs' ratios: {pairs:.3f})"
            "  target <= 1.05"
        )


if __name__ == "__main__":
    main()
