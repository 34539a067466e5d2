"""What both jobs of bench/bench_cohort_ddp.py share: the model, the data and the timed loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

BATCH = 64
WARMUP_STEPS = 20


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def make_dataset(steps: int, world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    n = world_size * BATCH * steps
    return TensorDataset(torch.randn(n, 32, generator=generator), torch.randn(n, 1, generator=generator))


def timed_loop(batches: Iterable, step: Callable[[torch.Tensor, torch.Tensor], None]) -> dict[str, float]:
    """Run ``step`` on every batch; the steady-state time per step excludes the first WARMUP_STEPS."""
    count = 0
    start = time.perf_counter()
    for x, y in batches:
        if count == WARMUP_STEPS:
            start = time.perf_counter()
        step(x, y)
        count += 1
    timed = count - WARMUP_STEPS
    return {"steps": count, "step_ms": (time.perf_counter() - start) * 1000 / max(timed, 1)}
