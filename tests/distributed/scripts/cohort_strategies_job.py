"""phalanx.Cohort where cohort_job.py does not go: accumulation, generator states, logging, model_parallel and DeepSpeed
stages 1-3, each against Trainer.fit on the same strategy. Usage: python cohort_strategies_job.py OUT MODE

MODE 'ddp': 2 ranks started by Cohort('ddp').launch(); the same processes then run
  - accumulation: the Cohort loop with no_backward_sync against Trainer.fit(accumulate_grad_batches=2);
  - rng: a loop with dropout saved after one epoch and resumed by a fresh Cohort, against the uninterrupted loop
    (and the same resume with restore_rng=False, which must differ);
  - logging: self.log / cohort.log / cohort.log_dict into a CSVLogger (rank zero writes);
  - model_parallel: a tensor-parallel TransformerBlock through the Cohort against Trainer.fit, save -> load, and the
    Trainer resuming the Cohort's sharded checkpoint;
  - fsdp_cpu_offload: the plain loop against Trainer.fit, the Trainer and a fresh Cohort loading its checkpoint;
  - pipeline: a loop through cohort.forward_backward over two pipeline stages, and the Cohort example of
    docs/pipeline.md (cohort_pipeline.py).
MODE 'deepspeed': stages 1 and 3 against Trainer.fit (and the Trainer resuming the Cohort's checkpoint); stages 1, 2
  and 3 with accumulation against Trainer.fit(accumulate_grad_batches=2); deepspeed_stage_{2,3}_offload against
  Trainer.fit.
Rank 0 writes OUT/MODE.json and the weights of some runs as OUT/NAME.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from cohort_pipeline import run_pipeline
from ddp_common import IndexedRegression, Net
from sharded_common import TransformerBlock, sequences
from torch import nn
from torch.utils.data import DataLoader

import phalanx

STEPS = 10  # optimizer updates of every run here
ACCUMULATE = 2
WEIGHTS: dict[str, dict[str, torch.Tensor]] = {}  # rank 0 saves each as OUT/NAME.pt


def quiet_trainer(strategy: Any, out: Path, **kwargs: Any) -> phalanx.Trainer:
    options: dict[str, Any] = dict(
        devices=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    options.update(kwargs)
    return phalanx.Trainer(strategy=strategy, **options)


def full_state(strategy: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (a collective: DTensors are gathered, ZeRO-3 partitions too)."""
    from phalanx.utilities.dtensor import full_module_state, has_dtensors

    state = full_module_state(module, keep=True) if has_dtensors(module) else strategy.module_state_dict()
    return {name: value.detach().float().clone() for name, value in state.items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def regression_loader() -> DataLoader:
    return DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True)


# ---------------------------------------------------------------------------- accumulation
def accumulating_cohort(strategy: str) -> dict[str, torch.Tensor]:
    """The hand-written accumulation loop: micro-batches that do not end a window run inside no_backward_sync."""
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    phalanx.seed_everything(0)
    net = Net(lr=0.05)
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = cohort.setup_dataloaders(regression_loader())
    for index, batch in enumerate(loader):
        if index == STEPS * ACCUMULATE:
            break
        ends_window = (index + 1) % ACCUMULATE == 0
        with cohort.no_backward_sync(model, enabled=not ends_window):
            cohort.backward(model.training_step(batch, index) / ACCUMULATE)
        if ends_window:
            optimizer.step()
            optimizer.zero_grad()
    return full_state(cohort.strategy, net)


def accumulating_trainer(strategy: str, out: Path) -> dict[str, torch.Tensor]:
    phalanx.seed_everything(0)
    net = Net(lr=0.05)
    # Under DeepSpeed global_step counts batches (as in Lightning), elsewhere optimizer updates.
    batches = STEPS * ACCUMULATE if strategy.startswith("deepspeed") else STEPS
    trainer = quiet_trainer(strategy, out, max_steps=batches, accumulate_grad_batches=ACCUMULATE)
    trainer.fit(net, regression_loader())
    return full_state(trainer.strategy, net)


def plain_cohort_loop(cohort: phalanx.Cohort, steps: int) -> tuple[Net, Any, Any]:
    phalanx.seed_everything(0)
    net = Net(lr=0.05)
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    loader = cohort.setup_dataloaders(regression_loader())
    for index, batch in enumerate(loader):
        if index == steps:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    return net, model, optimizer


class MomentumNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def parity_and_resume(strategy: str, out: Path) -> dict[str, Any]:
    """The plain loop against Trainer.fit on ``strategy``; the Trainer, and a fresh Cohort, load the Cohort's
    checkpoint."""
    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    cohort.launch()
    net, model, optimizer = plain_cohort_loop(cohort, STEPS)
    ours = full_state(cohort.strategy, net)
    checkpoint = out / f"{strategy}.ckpt"
    cohort.save(checkpoint, {"model": model, "optimizer": optimizer})
    phalanx.seed_everything(0)
    fitted = MomentumNet(lr=0.05)
    trainer = quiet_trainer(strategy, out, max_steps=STEPS)
    trainer.fit(fitted, regression_loader())
    result: dict[str, Any] = {"max_difference_to_trainer": max_difference(ours, full_state(trainer.strategy, fitted))}
    resumed = MomentumNet(lr=0.05)
    trainer = quiet_trainer(strategy, out, max_steps=STEPS + 2)
    trainer.fit(resumed, regression_loader(), ckpt_path=str(checkpoint))
    result["trainer_resumed_global_step"] = trainer.global_step
    fresh = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    net, model, optimizer = plain_cohort_loop(fresh, 0)
    fresh.load(checkpoint, {"model": model, "optimizer": optimizer})
    result["loaded"] = [max_difference(full_state(fresh.strategy, net), ours), fresh.global_step]
    return result


class CPUAdamNet(Net):
    def configure_optimizers(self) -> Any:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(self.parameters(), lr=0.01)


def offload_parity(strategy: str, out: Path, steps: int = 5) -> float:
    """ZeRO-Offload (optimizer, and under stage 3 parameters, on the CPU; DeepSpeedCPUAdam): the Cohort loop against
    Trainer.fit."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cohort = phalanx.Cohort(strategy=strategy, devices=2, accelerator="cpu")
    phalanx.seed_everything(0)
    net = CPUAdamNet()
    model, optimizer = cohort.setup(net, DeepSpeedCPUAdam(net.parameters(), lr=0.01))
    for index, batch in enumerate(cohort.setup_dataloaders(regression_loader())):
        if index == steps:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    ours = full_state(cohort.strategy, net)
    phalanx.seed_everything(0)
    fitted = CPUAdamNet()
    trainer = quiet_trainer(strategy, out, max_steps=steps)
    trainer.fit(fitted, regression_loader())
    return max_difference(ours, full_state(trainer.strategy, fitted))


def run_deepspeed(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for stage in (1, 2, 3):
        strategy = f"deepspeed_stage_{stage}"
        if stage != 2:  # stage 2 is compared with the Trainer by test_cohort_processes.py
            result[strategy] = parity_and_resume(strategy, out)
        cohort, trainer = accumulating_cohort(strategy), accumulating_trainer(strategy, out)
        result[f"{strategy}_accumulation_difference"] = max_difference(cohort, trainer)
        WEIGHTS[f"{strategy}_accumulation"] = cohort
    for strategy in ("deepspeed_stage_2_offload", "deepspeed_stage_3_offload"):
        result[f"{strategy}_difference"] = offload_parity(strategy, out)
    return result


# ---------------------------------------------------------------------------- generator states
class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dropout_epochs(cohort: phalanx.Cohort, model: Any, optimizer: Any, loader: Any, epochs: range) -> None:
    for epoch in epochs:
        loader.set_epoch(epoch)
        for x, y, _ in loader:
            optimizer.zero_grad()
            cohort.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()


def dropout_run(out: Path, *, resume: bool, restore_rng: bool = True) -> list[torch.Tensor]:
    """Two epochs of a loop with dropout; ``resume``: one epoch, save, a fresh Cohort loads and runs the second."""
    torch.manual_seed(0)
    cohort = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu")
    module = DropoutNet()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    dataset = IndexedRegression(n=64)
    loader = cohort.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
    dropout_epochs(cohort, model, optimizer, loader, range(1 if resume else 2))
    if not resume:
        return [p.detach().clone() for p in module.parameters()]
    path = out / "dropout.ckpt"
    cohort.save(path, {"model": model, "optimizer": optimizer, "epoch": 1})
    torch.manual_seed(100 + cohort.global_rank)  # another process's generators, until the load
    fresh = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu")
    module = DropoutNet()
    model, optimizer = fresh.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    loader = fresh.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    fresh.load(path, state, restore_rng=restore_rng)
    dropout_epochs(fresh, model, optimizer, loader, range(state["epoch"], 2))
    return [p.detach().clone() for p in module.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- logging
class LoggingNet(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        self.log("rank_sum", float(self.global_rank_for_test), sync_dist=True, reduce_fx="sum")
        self.log("own_rank", float(self.global_rank_for_test))  # only rank zero's value is written
        self.log_dict({"a": 1.0, "b": torch.tensor(2.0)}, prog_bar=True)  # one row with both
        self.log("not_written", 3.0, logger=False)
        return loss


def logging_run(out: Path) -> dict[str, Any]:
    from phalanx.loggers import CSVLogger

    logger = CSVLogger(save_dir=str(out / "logs"), name="cohort", version=0)
    cohort = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu", loggers=logger)
    net = LoggingNet()
    net.global_rank_for_test = cohort.global_rank
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    for index, batch in enumerate(cohort.setup_dataloaders(regression_loader())):
        if index == 3:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    cohort.log("lr", 0.05, step=100)
    cohort.log_dict({"epoch_metric": torch.tensor(7.0), "count": 3})
    logger.finalize("success")
    return {"csv": logger.metrics_file_path if cohort.is_global_zero else None, "global_step": cohort.global_step}


# ---------------------------------------------------------------------------- model_parallel
MODEL_PARALLEL_STEPS = 8  # one epoch of sequences() in batches of 8


def tensor_parallel_steps(cohort: phalanx.Cohort, model: Any, optimizer: Any, epochs: range) -> None:
    loader = cohort.setup_dataloaders(DataLoader(sequences(), batch_size=8))
    for _ in epochs:
        for index, batch in enumerate(loader):
            optimizer.zero_grad()
            cohort.backward(model.training_step(batch, index))
            optimizer.step()


def tensor_parallel_cohort() -> tuple[phalanx.Cohort, TransformerBlock, Any, Any]:
    cohort = phalanx.Cohort(strategy="model_parallel", devices=2, accelerator="cpu")
    cohort.launch()
    phalanx.seed_everything(13)
    block = TransformerBlock()
    model, optimizer = cohort.setup(block, torch.optim.SGD(block.parameters(), lr=0.02, momentum=0.9))
    return cohort, block, model, optimizer


def run_model_parallel(out: Path) -> dict[str, Any]:
    from phalanx.utilities.dtensor import is_dtensor

    cohort, block, model, optimizer = tensor_parallel_cohort()
    result: dict[str, Any] = {"sharded": sorted(name for name, p in block.named_parameters() if is_dtensor(p))}
    tensor_parallel_steps(cohort, model, optimizer, range(1))
    checkpoint = out / "model_parallel.ckpt"
    cohort.save(checkpoint, {"model": model, "optimizer": optimizer, "epoch": 1})
    saved = full_state(cohort.strategy, block)
    tensor_parallel_steps(cohort, model, optimizer, range(1))  # a second epoch: 16 steps in all
    ours = full_state(cohort.strategy, block)
    result["losses"] = block.losses

    loaded_cohort, loaded, model, optimizer = tensor_parallel_cohort()
    loaded_cohort.load(checkpoint, {"model": model, "optimizer": optimizer})
    result["loaded_difference_to_saved"] = max_difference(full_state(loaded_cohort.strategy, loaded), saved)
    tensor_parallel_steps(loaded_cohort, model, optimizer, range(1))  # momentum restored: ends where `ours` ends
    result["loaded_then_trained_difference"] = max_difference(full_state(loaded_cohort.strategy, loaded), ours)

    phalanx.seed_everything(13)
    fitted = TransformerBlock()
    trainer = quiet_trainer("model_parallel", out, max_steps=2 * MODEL_PARALLEL_STEPS)
    trainer.fit(fitted, DataLoader(sequences(), batch_size=8))
    result["trainer_difference"] = max_difference(ours, full_state(trainer.strategy, fitted))
    resumed = TransformerBlock()
    trainer = quiet_trainer("model_parallel", out, max_steps=2 * MODEL_PARALLEL_STEPS)
    trainer.fit(resumed, DataLoader(sequences(), batch_size=8), ckpt_path=str(checkpoint))
    result["trainer_resumed"] = [len(resumed.losses), trainer.global_step]
    result["trainer_resumed_difference"] = max_difference(ours, full_state(trainer.strategy, resumed))
    WEIGHTS["model_parallel"] = ours
    return result


def run_ddp(out: Path) -> dict[str, Any]:
    cohort = phalanx.Cohort(strategy="ddp", devices=2, accelerator="cpu")
    cohort.launch()
    result: dict[str, Any] = {"world_size": cohort.world_size}
    ours = WEIGHTS["ddp_accumulation"] = accumulating_cohort("ddp")
    result["accumulation_bitwise"] = equal(list(ours.values()), list(accumulating_trainer("ddp", out).values()))
    straight = dropout_run(out, resume=False)
    result["rng_resumed_bitwise"] = equal(dropout_run(out, resume=True), straight)
    result["rng_not_restored_differs"] = not equal(dropout_run(out, resume=True, restore_rng=False), straight)
    result["logging"] = logging_run(out)
    result["model_parallel"] = run_model_parallel(out)
    result["fsdp_cpu_offload"] = parity_and_resume("fsdp_cpu_offload", out)
    result["pipeline"] = run_pipeline(out)
    return result


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    result = run_ddp(out) if mode == "ddp" else run_deepspeed(out)
    if torch.distributed.get_rank() == 0:
        for name, state in WEIGHTS.items():
            torch.save(state, out / f"{name}.pt")
        (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
