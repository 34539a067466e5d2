"""torch.compile through Trainer.fit on each parallel strategy at 2 CPU processes: compiled against eager weights,
checkpoints resumed across eager and compiled runs, compilations and graph breaks counted.

Usage: python compile_job.py OUT STRATEGY... ; every strategy runs in the same 2 ranks (the first Trainer starts the
second). Per strategy: eager and compiled (aot_eager, counted) for STEPS steps, each saving a checkpoint; the compiled
run resumes the eager checkpoint and the eager run the compiled one for one more step, against STEPS + 1 eager steps.
'ddp' also runs ``fit(torch.compile(model))`` and inductor, 'fsdp' also with activation checkpointing. Rank 0 writes
OUT/STRATEGY.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.utilities.dtensor import full_module_state, has_dtensors

WIDTH, STEPS = 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def configure_model(self) -> None:
        mesh = self.device_mesh  # model_parallel: shard each block, then the root, over the data-parallel ranks
        if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def strategy_for(name: str) -> Any:
    if name == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "fsdp_checkpointed":  # activation checkpointing of each block, then compilation, then sharding
        return FSDPStrategy(activation_checkpointing_policy={Block})
    return name


def fit(name: str, out: Path, steps: int, model: Any = None, ckpt: Path | None = None, **kwargs: Any) -> Any:
    """Fit ``steps`` steps (resuming ``ckpt``), save OUT/<tag>.ckpt; the full weights and the module."""
    phalanx.seed_everything(0)
    net = Net() if model is None else model
    trainer = phalanx.Trainer(
        strategy=strategy_for(name),
        devices=2,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
        **kwargs,
    )
    trainer.fit(net, data(), ckpt_path=None if ckpt is None else str(ckpt))
    module = trainer.strategy.module
    state = full_module_state(module, keep=True) if has_dtensors(module) else trainer.strategy.module_state_dict()
    return trainer, {key: value.detach().float().clone() for key, value in state.items()}


def counted() -> CompileCounterWithBackend:
    torch._dynamo.reset()
    counters.clear()
    return CompileCounterWithBackend("aot_eager")


def run(name: str, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    trainer, result["eager"] = fit(name, out, STEPS)
    eager_ckpt = out / f"{name}-eager.ckpt"
    trainer.save_checkpoint(eager_ckpt)
    counter = counted()
    trainer, result["compiled"] = fit(name, out, STEPS, compile={"backend": counter})
    result["frames"], result["graph_breaks"] = counter.frame_count, sum(counters["graph_break"].values())
    module = trainer.strategy.module
    result["compiled_modules"] = [
        name for name, child in module.named_modules() if child._compiled_call_impl is not None
    ]
    result["compiled_modules"] += ["<forward>"] if "forward" in module.__dict__ else []
    compiled_ckpt = out / f"{name}-compiled.ckpt"
    trainer.save_checkpoint(compiled_ckpt)
    if compiled_ckpt.is_file():  # sharded strategies write a directory of their own format
        result["compiled_ckpt_keys"] = sorted(torch.load(compiled_ckpt, weights_only=False)["state_dict"])
    result["rank"] = trainer.global_rank
    counter = counted()
    _, result["compiled_from_eager"] = fit(name, out, STEPS + 1, ckpt=eager_ckpt, compile={"backend": counter})
    result["resumed_frames"] = counter.frame_count
    _, result["eager_from_compiled"] = fit(name, out, STEPS + 1, ckpt=compiled_ckpt)
    _, result["straight"] = fit(name, out, STEPS + 1)
    if name == "fsdp":
        _, result["checkpointed_eager"] = fit("fsdp_checkpointed", out, STEPS)
        counter = counted()
        trainer, result["checkpointed"] = fit("fsdp_checkpointed", out, STEPS, compile={"backend": counter})
        result["checkpointed_frames"] = counter.frame_count
        result["checkpointed_graph_breaks"] = sum(counters["graph_break"].values())
    if name == "ddp":
        torch._dynamo.reset()
        phalanx.seed_everything(0)
        _, result["precompiled"] = fit(name, out, STEPS, model=torch.compile(Net(), backend="aot_eager"))
        torch._dynamo.reset()
        _, result["inductor"] = fit(name, out, STEPS, compile=True)
    return result


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    for name in names:
        result = run(name, out)
        if result["rank"] == 0:
            torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main()
