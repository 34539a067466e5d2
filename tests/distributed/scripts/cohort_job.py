"""The same hand-written loop through phalanx.Cohort, torch's DDP by hand and the Trainer, in one job. Usage: python
cohort_job.py OUT MODE

MODE 'ddp': 2 ranks started by the Cohort re-running this script; rank 0 writes OUT/ddp.json with every comparison.
MODE 'spawn': Cohort.launch(fn) on ddp_spawn then on ddp_fork; the main process writes OUT/spawn.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net
from strategy_cases import promising
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import phalanx
from phalanx.strategies.ddp import DDPStrategy

STEPS = 50


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def cohort_loop(cohort: phalanx.Cohort, steps: int = STEPS) -> list[torch.Tensor]:
    """reference_ddp.py's loop, written against the Cohort."""
    module = plain_model()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05))
    loader = cohort.setup_dataloaders(DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    for step, (x, y, _) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        cohort.backward(loss)
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


def torch_ddp_loop(rank: int, world_size: int) -> list[torch.Tensor]:
    """reference_ddp.py's loop with torch alone (the process group is the one the Cohort joined)."""
    model = plain_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    dataset = IndexedRegression(n=800)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    for step, (x, y, _) in enumerate(DataLoader(dataset, batch_size=8, sampler=sampler)):
        if step == STEPS:
            break
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


class CountingDDP(DDPStrategy):
    """The docs' example: a strategy that customises how the module is wrapped."""

    calls = 0

    def configure_ddp(self) -> None:
        CountingDDP.calls += 1
        super().configure_ddp()


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def run_ddp(out: Path) -> None:
    cohort = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu")
    cohort.launch()
    rank, world_size = cohort.global_rank, cohort.world_size
    ours = cohort_loop(cohort)
    reference = torch_ddp_loop(rank, world_size)
    checkpoint = str(out / "cohort.ckpt")
    result = {"world_size": world_size, "cohort_equals_torch_ddp": equal(ours, reference)}

    # The Trainer on the same strategy, with the same module and data: Net's training_step is the same loss.
    phalanx.seed_everything(0)
    net = Net(lr=0.05)
    trainer = phalanx.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(net, DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    result["trainer_equals_cohort"] = equal([p.detach() for p in net.parameters()], ours)
    trainer.save_checkpoint(str(out / "trainer.ckpt"))

    # A Cohort-driven TrainingModule (training_step through DDP's forward) saves; the Trainer resumes it, and back.
    phalanx.seed_everything(0)
    second = phalanx.Cohort(strategy=CountingDDP(), devices=2, accelerator="cpu")
    net2 = Net(lr=0.05)
    model, optimizer = second.setup(net2, torch.optim.SGD(net2.parameters(), lr=0.05))
    loader = second.setup_dataloaders(DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    for index, batch in enumerate(loader):
        if index == STEPS:
            break
        optimizer.zero_grad()
        second.backward(model.training_step(batch, index))
        optimizer.step()
    result["training_step_equals_cohort"] = equal([p.detach() for p in net2.parameters()], ours)
    second.save(checkpoint, {"model": model, "optimizer": optimizer})
    resumed = Net(lr=0.05)
    trainer = phalanx.Trainer(
        strategy=CountingDDP(),
        devices=2,
        accelerator="cpu",
        max_steps=STEPS + 5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(resumed, DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True), ckpt_path=checkpoint)
    result["trainer_resumed_global_step"] = trainer.global_step
    result["configure_ddp_calls"] = CountingDDP.calls

    third = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu")
    net3 = Net(lr=0.05)
    model3, optimizer3 = third.setup(net3, torch.optim.SGD(net3.parameters(), lr=0.05))
    state = {"model": model3, "optimizer": optimizer3, "global_step": 0}
    third.load(str(out / "trainer.ckpt"), state)
    result["cohort_loaded_trainer_weights"] = equal([p.detach() for p in net3.parameters()], ours)
    result["cohort_loaded_global_step"] = [state["global_step"], third.global_step]
    result["all_reduce_mean"] = float(cohort.all_reduce(torch.tensor(float(rank))))
    result["all_gather"] = cohort.all_gather(torch.tensor([rank])).flatten().tolist()
    result["broadcast"] = cohort.broadcast(f"from {rank}")
    if cohort.is_global_zero:
        torch.save(reference, out / "torch_ddp.pt")
        (out / "ddp.json").write_text(json.dumps(result))


def spawned(cohort: phalanx.Cohort) -> list[torch.Tensor]:
    return cohort_loop(cohort)


def run_spawn(out: Path) -> None:
    results = {}
    for strategy in [row.name for row in promising("cohort") if row.launches]:  # tests/strategy_cases.py
        cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
        results[strategy] = [p.tolist() for p in cohort.launch(spawned)]
    (out / "spawn.json").write_text(json.dumps(results))


def full_weights(module: nn.Module) -> list[torch.Tensor]:
    from phalanx.utilities.dtensor import full_module_state

    return [tensor.detach().clone() for tensor in full_module_state(module, keep=True).values()]


def run_sharded(out: Path, strategy: str) -> None:
    """The Cohort loop and Trainer.fit on a sharded strategy, against each other and the DDP weights; save -> load."""
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    phalanx.seed_everything(0)
    net = Net(lr=0.05)
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = cohort.setup_dataloaders(DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    for index, batch in enumerate(loader):
        if index == STEPS:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    ours = full_weights(net)
    checkpoint = out / f"{strategy}.ckpt"
    cohort.save(checkpoint, {"model": model, "optimizer": optimizer})
    phalanx.seed_everything(0)
    fitted = Net(lr=0.05)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(fitted, DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    theirs = full_weights(fitted)
    result = {"max_difference_to_trainer": max(float((a - b).abs().max()) for a, b in zip(ours, theirs))}
    resumed = Net(lr=0.05)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=STEPS + 2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(resumed, DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True), ckpt_path=str(checkpoint))
    result["trainer_resumed_global_step"] = trainer.global_step
    if cohort.is_global_zero:
        torch.save(ours, out / f"{strategy}.pt")
        (out / f"{strategy}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    target, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "ddp":
        run_ddp(target)
    elif mode == "spawn":
        run_spawn(target)
    else:
        run_sharded(target, mode)
