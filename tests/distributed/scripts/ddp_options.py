"""DDPStrategy options in one job on 2 CPU processes; each rank writes its results.

Usage: python ddp_options.py OUT_DIR [unused]
"""

import sys
from functools import partial
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net, write_json
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader

import phalanx
from phalanx.strategies import DDPStrategy

HOOK_CALLS = []


def counting_hook(state, bucket):
    HOOK_CALLS.append(1)
    return default_hooks.allreduce_hook(state, bucket)


class Manual(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        optimizer = self.optimizers()
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class AdamNet(Net):
    """Adam, plain or split across the ranks by ZeroRedundancyOptimizer (the same updates either way)."""

    def __init__(self, zero=False):
        super().__init__()
        self.zero = zero

    def configure_optimizers(self):
        if self.zero:
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Unused(Net):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 1)


def fit(module, strategy, steps=6):
    phalanx.seed_everything(11)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(IndexedRegression(n=96), batch_size=4, shuffle=True))
    return trainer, [p.detach().flatten().tolist() for p in module.parameters()]


def fresh(kind=Net):
    torch.manual_seed(0)
    return kind()


def main() -> None:
    out = Path(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2] == "unused":
        fit(fresh(Unused), "ddp")
        return
    results = {}
    trainer, results["automatic"] = fit(fresh(), "ddp")
    rank = trainer.global_rank
    _, results["manual"] = fit(fresh(Manual), "ddp")
    _, results["comm_hook"] = fit(
        fresh(), DDPStrategy(ddp_comm_hook=counting_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    )
    results["hook_calls"] = len(HOOK_CALLS)
    _, results["static_graph"] = fit(fresh(), DDPStrategy(static_graph=True))
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2)
    averaged_trainer, results["averaging"] = fit(
        fresh(), DDPStrategy(ddp_comm_state=state, ddp_comm_hook=post_localSGD_hook, model_averaging_period=2), steps=8
    )
    results["averaging_optimizer"] = type(averaged_trainer.optimizers[0]).__name__
    for name, zero in (("adam", False), ("zero", True)):
        zero_trainer, results[name] = fit(fresh(partial(AdamNet, zero=zero)), "ddp")
        zero_trainer.save_checkpoint(out / f"{name}.ckpt")  # every rank takes part: ZeRO gathers its shards on rank 0
    write_json(out, f"rank{rank}.json", results)


if __name__ == "__main__":
    main()
