"""Pipeline parallelism on 2 CPU processes: step time against the number of micro-batches, and memory per rank.

``ModelParallelStrategy(pipeline_parallel_size=2)`` trains a residual MLP (an input layer, BLOCKS blocks of
LayerNorm + Linear(WIDTH, WIDTH) + tanh, a head; the blocks split evenly, the input layer with the first stage and
the head with the last) with AdamW, batch BATCH, one thread per process, under GPipe and 1F1B with m = 2, 4 and 8
micro-batches. One launch runs every setting (phalanx starts the second process).

Time: the median of the training steps after WARMUP (each step timed on every rank, the slower rank's median
kept), beside the schedule's bubble fraction (p - 1) / (m + p - 1) for p = 2 stages. If the stages' compute were all
that counted, a step would take compute / (1 - bubble): the column ``predicted`` is that time relative to m = 2's,
``measured`` the same ratio for the measured times (splitting a batch finer also adds per-micro-batch overhead,
which the formula leaves out). ``ideal`` is the step time of a perfect split: the whole model's step in a plain
one-process loop, divided by the stages, divided by (1 - bubble).

Memory: the bytes each rank holds at the end of a step (parameters, their gradients, AdamW's two moments: 4 bytes
per parameter each in float32), against the formula 4 x parameters / stages. Activations are not counted.

Usage: python bench/bench_pipeline.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import ModelParallelStrategy
from phalanx.strategies.pipeline_split import keep_stages

WIDTH, BLOCKS, BATCH, WARMUP, STAGES = 512, 8, 256, 2, 2
SETTINGS = [(schedule, m) for schedule in ("GPipe", "1F1B") for m in (2, 4, 8)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(32, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head: nn.Module | None = nn.Linear(WIDTH, 1)
        self.times: list[float] = []
        self.held: dict[str, int] = {}
        self._start = 0.0

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        keep_stages(
            self, "blocks", strategy.pipeline_stages, strategy.num_pipeline_stages, first=["embed"], last=["head"]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # The gradients exist from the schedule's backward to the optimizer step.
        self.held["gradients"] = sum(
            p.grad.numel() * p.grad.element_size() for p in self.parameters() if p.grad is not None
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._start)
        optimizer = self.trainer.optimizers[0]
        self.held |= {
            "parameters": sum(p.numel() * p.element_size() for p in self.parameters()),
            "optimizer": sum(
                value.numel() * value.element_size()
                for state in optimizer.state.values()
                for key, value in state.items()
                if key != "step" and isinstance(value, torch.Tensor)
            ),
        }

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def whole_model_bytes() -> int:
    model = Net()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def one_process_step(steps: int) -> float:
    """The median step time of the whole model in a plain loop on one process (no pipeline, no Trainer)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, 32), torch.randn(BATCH, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def run(schedule: str, microbatches: int, steps: int) -> tuple[Any, list[Any]]:
    phalanx.seed_everything(0)
    data = TensorDataset(torch.randn(BATCH * steps, 32), torch.randn(BATCH * steps, 1))
    module = Net()
    strategy = ModelParallelStrategy(
        pipeline_parallel_size=STAGES, pipeline_schedule=schedule, microbatches=microbatches
    )
    trainer = phalanx.Trainer(
        accelerator="cpu",
        devices=STAGES,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return trainer, trainer.strategy.all_gather_object((statistics.median(module.times[WARMUP:]), module.held))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per setting (the first 2 untimed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    total = whole_model_bytes()
    alone = one_process_step(args.steps)  # before the first fit starts the second process
    rows = []
    for schedule, microbatches in SETTINGS:
        trainer, ranks = run(schedule, microbatches, args.steps)
        rows.append((schedule, microbatches, max(seconds for seconds, _ in ranks), [held for _, held in ranks]))
    if not trainer.is_global_zero:
        return
    print(f"model: {total / 2**20:.2f} MiB of float32 parameters, {STAGES} stages, batch {BATCH}, {args.steps} steps")
    print(f"one process, whole model, plain loop: {alone * 1e3:.1f} ms/step")
    print(f"{'schedule':<6} {'m':>2} {'bubble':>7} {'ms/step':>8} {'ideal':>7} {'measured':>9} {'predicted':>9}")
    for schedule, microbatches, seconds, _ in rows:
        bubble = (STAGES - 1) / (microbatches + STAGES - 1)
        first = next(s for name, m, s, _ in rows if name == schedule and m == 2)
        predicted = (1 - (STAGES - 1) / (2 + STAGES - 1)) / (1 - bubble)
        print(
            f"{schedule:<6} {microbatches:>2} {bubble:>7.3f} {seconds * 1e3:>8.1f}"
            f" {alone / STAGES / (1 - bubble) * 1e3:>7.1f} {seconds / first:>9.3f}"
            f" {predicted:>9.3f}"
        )
    predicted_rank = 4 * total / STAGES
    header = f"{'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'adamw MiB':>10} {'sum MiB':>8}"
    print(f"{header} {'4P/stages':>10} {'ratio':>6}")
    for rank, held in enumerate(rows[-1][3]):
        held_sum = held["parameters"] + held["gradients"] + held["optimizer"]
        print(
            f"{rank:>4} {held['parameters'] / 2**20:>11.3f} {held['gradients'] / 2**20:>10.3f}"
            f" {held['optimizer'] / 2**20:>10.3f} {held_sum / 2**20:>8.3f} {predicted_rank / 2**20:>10.3f}"
            f" {held_sum / predicted_rank:>6.3f}"
        )
    print(json.dumps({"alone": alone, "rows": [(s, m, t) for s, m, t, _ in rows], "held": rows[-1][3], "total": total}))


if __name__ == "__main__":
    main()
