"""loss.backward() instead of cohort.backward(loss) on 2 CPU ranks. Usage: python cohort_backward_job.py OUT MODE

MODE 'torch' runs ddp and fsdp, MODE 'deepspeed' deepspeed_stage_2: an accumulation loop (no_backward_sync, 2 batches
per step) once with cohort.backward(loss) and once with loss.backward(). Rank 0 writes OUT/MODE.json with, per
strategy, the largest weight difference between the two runs, or the error the plain loss.backward() raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from ddp_common import IndexedRegression
from torch import nn
from torch.utils.data import DataLoader

import phalanx

ACCUMULATE = 2
BATCHES = 6


def loop(strategy: str, plain_backward: bool) -> dict[str, torch.Tensor]:
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    phalanx.seed_everything(0)
    module = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=0.01))
    loader = cohort.setup_dataloaders(DataLoader(IndexedRegression(n=24), batch_size=2))
    for index, (x, y, _) in enumerate(loader):
        window_ends = (index + 1) % ACCUMULATE == 0
        with cohort.no_backward_sync(model, enabled=not window_ends):
            loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
            if plain_backward:
                loss.backward()
            else:
                cohort.backward(loss)
        if window_ends:
            optimizer.step()
            optimizer.zero_grad()
        if index + 1 == BATCHES:
            break
    return {name: value.detach().float().clone() for name, value in cohort.strategy.module_state_dict().items()}


def outcome(strategy: str) -> Any:
    expected = loop(strategy, plain_backward=False)
    try:
        got = loop(strategy, plain_backward=True)
    except RuntimeError as error:
        return {"error": str(error)}
    if torch.distributed.get_rank() != 0:
        return None  # (some strategies gather the whole state on rank 0 only; rank 0 reports)
    return {"difference": max(float((got[name] - expected[name]).abs().max()) for name in expected)}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    strategies = ("ddp", "fsdp") if mode == "torch" else ("deepspeed_stage_2",)
    result = {strategy: outcome(strategy) for strategy in strategies}
    if torch.distributed.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
