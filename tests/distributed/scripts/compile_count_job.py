"""What dynamo compiles for issue 37's model (tests/phalanx_compile.py) on each parallel strategy at 2 CPU processes,
asked either way, under 'bf16-mixed', with the Trainer's defaults on (sanity check, validation batches of another
size, logger, checkpoints, progress bar, model summary); and through a Cohort.

Usage: python compile_count_job.py OUT STRATEGY... ; every run uses the same 2 ranks (the first Trainer starts the
second). Rank 0 writes OUT/STRATEGY.pt: per way of asking, each recorded graph (grad mode, dynamic sizes, matmul input
dtypes), graph breaks, the compiled modules' names, and the unit the strategy compiled.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from phalanx_compile import LAYERS, GPTModule, Recorder, token_data
from torch._dynamo.utils import counters

import phalanx
from phalanx.strategies import ModelParallelStrategy

TRAIN_BATCH, VAL_BATCH = 2, 3
#: The strategies that compile the whole GPT trace it as one graph: 3 blocks keep that quick (see GPTModule).
WHOLE_GPT = ("ddp", "deepspeed_stage_2", "cohort")


def layers(name: str) -> int:
    return 3 if name in WHOLE_GPT else LAYERS


def strategy_for(name: str) -> Any:
    if name == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return name


def compiled_names(module: torch.nn.Module) -> list[str]:
    """The submodules compiled in place (a compiled ``_call_impl``), and '<forward>' for the module's own forward."""
    names = [name for name, child in module.named_modules() if child._compiled_call_impl is not None]
    return names + (["<forward>"] if "forward" in module.__dict__ else [])


def summary(recorder: Recorder, module: torch.nn.Module) -> dict[str, Any]:
    return {
        "graphs": [(graph.grad_enabled, graph.dynamic) for graph in recorder.graphs],
        "dtypes": sorted(recorder.matmul_dtypes()),
        "matmuls": sum(len(graph.forward_matmuls) for graph in recorder.graphs if graph.grad_enabled),
        "graph_breaks": sum(counters["graph_break"].values()),
        "compiled": compiled_names(module),
    }


def fit(name: str, out: Path, how: str) -> tuple[int, dict[str, Any]]:
    torch._dynamo.reset()
    counters.clear()
    recorder = Recorder()
    phalanx.seed_everything(0)
    module = GPTModule(layers(name))
    model: Any = torch.compile(module, backend=recorder) if how == "precompiled" else module
    trainer = phalanx.Trainer(
        strategy=strategy_for(name), devices=2, accelerator="cpu", precision="bf16-mixed", max_epochs=1,
        default_root_dir=str(out / name / how), compile=None if how == "precompiled" else {"backend": recorder},
    )  # fmt: skip
    trainer.fit(model, token_data(6, TRAIN_BATCH), token_data(2, VAL_BATCH, seed=1))
    return trainer.global_rank, summary(recorder, module)


def cohort(out: Path) -> tuple[int, dict[str, Any]]:
    """DDP through a Cohort: a hand-written loop's steps, with phalanx compiling the model."""
    torch._dynamo.reset()
    counters.clear()
    recorder = Recorder()
    phalanx.seed_everything(0)
    module = GPTModule(layers("cohort"))
    runner = phalanx.Cohort(
        strategy="ddp", devices=2, accelerator="cpu", precision="bf16-mixed", compile={"backend": recorder}
    )
    runner.launch()
    model, optimizer = runner.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    for batch in token_data(4, TRAIN_BATCH):
        loss = model.training_step(batch, 0)  # through the DDP wrapper, under the Cohort's autocast
        runner.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return runner.global_rank, summary(recorder, module)


def main() -> None:
    torch.set_num_threads(1)  # aot_eager's many small kernels crawl with two threads per rank on a shared machine
    out, names = Path(sys.argv[1]), sys.argv[2:]
    for name in names:
        result: dict[str, Any] = {}
        rank = 0
        if name == "cohort":
            rank, result["cohort"] = cohort(out)
        else:
            for how in ("argument", "precompiled"):
                rank, result[how] = fit(name, out, how)
        if rank == 0:
            torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main()
