"""Cohort.load_raw and the Fabric-style resume loop on 2 CPU ranks. Usage: python cohort_habits_job.py OUT MODE

MODE 'torch' runs ddp and fsdp, MODE 'deepspeed' deepspeed_stage_2 and deepspeed_stage_3 (resume on stage 2 only):
  - load_raw: a module made under init_module(empty_init=True), set up, loads a plain torch.save(state_dict()) file,
    then takes one step at lr=0: the whole weights must equal the file's;
  - resume: a shuffled loop saved mid-epoch, resumed by a fresh Cohort that skips the trained batches, against the
    uninterrupted loop.
Rank 0 writes OUT/MODE.json with the largest differences.
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

TOTAL_STEPS = 9
SAVE_AT = 4  # in the first epoch (6 batches per rank)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def full_state(cohort: phalanx.Cohort) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().clone() for name, value in cohort.strategy.module_state_dict().items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if not torch.distributed.get_rank() == 0:
        return float("nan")  # (some strategies gather the whole state on rank 0 only; rank 0 reports)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def started(strategy: str) -> phalanx.Cohort:
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    return cohort


def load_raw_difference(strategy: str, out: Path) -> float:
    cohort = started(strategy)
    torch.manual_seed(7)
    pretrained = make_net().state_dict()
    path = out / f"{strategy}_raw.pt"
    if cohort.is_global_zero:
        torch.save(pretrained, path)
    cohort.barrier()
    torch.manual_seed(100 + cohort.global_rank)  # other weights on every rank until the load
    with cohort.init_module(empty_init=True):
        module = make_net()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.0))
    cohort.load_raw(path, model)
    optimizer.zero_grad()
    cohort.backward(model(torch.ones(2, 4, device=cohort.device)).sum())
    optimizer.step()
    return largest_difference(full_state(cohort), {k: v.float() for k, v in pretrained.items()})


def resumable_loop(strategy: str, path: Path, *, save_at: int | None, resume: bool) -> dict[str, torch.Tensor]:
    cohort = started(strategy)
    phalanx.seed_everything(0)
    module = make_net()
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=0.01))
    loader = cohort.setup_dataloaders(DataLoader(IndexedRegression(n=24), batch_size=2, shuffle=True))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        cohort.load(path, state)
    step = state["step"]
    epoch, skip = divmod(step, len(loader))
    loader.set_epoch(epoch)
    while step < TOTAL_STEPS:
        for index, (x, y, _) in enumerate(loader):
            if index < skip:
                continue
            optimizer.zero_grad()
            cohort.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            step += 1
            if step == save_at:
                cohort.save(path, {"model": model, "optimizer": optimizer, "step": step})
            if step == TOTAL_STEPS:
                break
        skip = 0
    return full_state(cohort)


def resume_difference(strategy: str, out: Path) -> float:
    path = out / f"{strategy}_mid.ckpt"
    straight = resumable_loop(strategy, path, save_at=SAVE_AT, resume=False)
    torch.manual_seed(1234)  # a new process's generators until the load
    return largest_difference(resumable_loop(strategy, path, save_at=None, resume=True), straight)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "torch":
        raw, resumed = ("ddp", "fsdp"), ("ddp", "fsdp")
    else:
        raw, resumed = ("deepspeed_stage_2", "deepspeed_stage_3"), ("deepspeed_stage_2",)
    result: dict[str, Any] = {}
    for strategy in raw:
        result[f"{strategy}_load_raw"] = load_raw_difference(strategy, out)
    for strategy in resumed:
        result[f"{strategy}_resume"] = resume_difference(strategy, out)
    if torch.distributed.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
