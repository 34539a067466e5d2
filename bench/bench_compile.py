"""The CPU twin of the GPU benchmark's compiled runs (issue 37): hand-written loops against phalanx, with inductor.

The GPT of issue 37's independent benchmark (``bench/gpu/model.py``, style "independent": exact GELU, q/k/v split by
one view and permute, the GPT held by the TrainingModule as an attribute, its 12 blocks in a ModuleList, batches from
a CPU DataLoader) in ``--shape`` tiny (width 32, context 16, vocabulary 64) or medium (width 128, context 64,
vocabulary 512), bf16-mixed, AdamW. Runs, all in this process, interleaved: the loop eager, compiled whole
(``gpt.compile()``, the loss outside) and compiled per block (``block.compile()``), alone and wrapped in
DistributedDataParallel at world size 1; phalanx eager and ``compile=True`` (the strategy's unit), and with each unit
asked for, on ``single_device`` and ``ddp`` at world size 1. Each run is a fresh model after
``torch._dynamo.reset()``; its first ``--warmup`` steps (compilation included) are not timed, its next ``--steps``
are, in this process's CPU time by default (``--clock``). The best of ``--rounds`` interleaved rounds is compared
(the least disturbed).
Usage: python bench/bench_compile.py [--shape tiny] [--rounds 3] [--steps 30] [--warmup 3] [--runs loop,phalanx]
[--backend inductor] [--clock process]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))  # the GPU benchmark's models
from model import Shape, batches, build, next_token_loss  # noqa: E402

import phalanx  # noqa: E402

SHAPES = {
    "tiny": Shape(layers=12, width=32, heads=4, context=16, batch=2, vocab=64, style="independent"),
    "medium": Shape(layers=12, width=128, heads=4, context=64, batch=4, vocab=512, style="independent"),
}
#: run name: (who trains, strategy, the unit compiled: None eager, "default" the strategy's, "model" or "blocks").
RUNS: dict[str, tuple[str, str, str | None]] = {
    "loop": ("loop", "single_device", None),
    "loop_compiled_model": ("loop", "single_device", "model"),
    "loop_compiled_blocks": ("loop", "single_device", "blocks"),
    "ddp_loop": ("loop", "ddp", None),
    "ddp_loop_compiled_model": ("loop", "ddp", "model"),
    "ddp_loop_compiled_blocks": ("loop", "ddp", "blocks"),
    "phalanx": ("phalanx", "single_device", None),
    "phalanx_compiled": ("phalanx", "single_device", "default"),
    "phalanx_compiled_model": ("phalanx", "single_device", "model"),
    "phalanx_compiled_blocks": ("phalanx", "single_device", "blocks"),
    "ddp": ("phalanx", "ddp", None),
    "ddp_compiled": ("phalanx", "ddp", "default"),
    "ddp_compiled_model": ("phalanx", "ddp", "model"),
    "ddp_compiled_blocks": ("phalanx", "ddp", "blocks"),
}
DEFAULT_RUNS = (
    "loop,loop_compiled_model,loop_compiled_blocks,phalanx,phalanx_compiled,phalanx_compiled_blocks,"
    "ddp_loop,ddp_loop_compiled_model,ddp_loop_compiled_blocks,ddp,ddp_compiled,ddp_compiled_blocks"
)
LR = 3e-4
#: Clocks for the timed window: this process's CPU time (the default: on a shared, loaded machine the wall clock also
#: counts the time other processes held the cores) or the wall clock.
CLOCKS = {"process": time.process_time, "wall": time.perf_counter}


class Meter:
    """Times steps ``[warmup, warmup + steps)`` with ``clock``; called at the start and end of every step."""

    def __init__(self, warmup: int, steps: int, clock: str) -> None:
        self.warmup, self.steps, self.clock = warmup, steps, CLOCKS[clock]
        self.began = self.seconds = 0.0

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def step_start(self, index: int) -> None:
        if index == self.warmup:
            self.began = self.clock()

    def step_end(self, index: int) -> None:
        if index == self.warmup + self.steps - 1:
            self.seconds = self.clock() - self.began


def loop(shape: Shape, strategy: str, unit: str | None, backend: str, meter: Meter) -> None:
    """A hand-written loop: autocast to bfloat16, backward, AdamW; ``unit`` compiles the GPT or each block in place,
    then "ddp" wraps it in DistributedDataParallel (a one-process gloo group)."""
    torch.manual_seed(0)
    gpt = build(shape)
    if unit == "model":
        gpt.compile(backend=backend)
    elif unit == "blocks":
        for block in gpt.blocks:
            block.compile(backend=backend)
    model: Any = gpt
    # phalanx's DDP leaves its one-process group behind after fit (as Lightning's does): use it where it is there.
    started = strategy == "ddp" and not torch.distributed.is_initialized()
    if started:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(gpt)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=LR)
    try:
        for index, batch in enumerate(batches(shape, torch.device("cpu"), meter.total_steps)):
            meter.step_start(index)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = next_token_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meter.step_end(index)
    finally:
        if started:
            torch.distributed.destroy_process_group()


class GPTModule(phalanx.TrainingModule):
    """The GPT as an attribute of the TrainingModule, as the independent benchmark held it."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.gpt = build(shape)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return next_token_loss(self.gpt, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class Timed(phalanx.Callback):
    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.meter.step_start(batch_idx)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.meter.step_end(batch_idx)


def fit(shape: Shape, strategy: str, unit: str | None, backend: str, meter: Meter) -> None:
    """phalanx with its defaults off (no logger, bar, checkpoint, summary or sanity check)."""
    compile_ = None if unit is None else {"backend": backend, **({} if unit == "default" else {"unit": unit})}
    torch.manual_seed(0)
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=meter.total_steps,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, compile=compile_, callbacks=[Timed(meter)],
    )  # fmt: skip
    trainer.fit(GPTModule(shape), batches(shape, torch.device("cpu"), meter.total_steps))


def measure(name: str, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """One run from a fresh dynamo state: ms per step over the timed window, and what dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    meter = Meter(args.warmup, args.steps, args.clock)
    who, strategy, unit = RUNS[name]
    if who == "loop":
        loop(shape, strategy, unit, args.backend, meter)
    else:
        fit(shape, strategy, unit, args.backend, meter)
    return {
        "ms": 1000.0 * meter.seconds / args.steps,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each run is compared")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (the smoke test: eager)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="process", help="CPU time of this process, or wall")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, from: {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        parser.error(f"--runs names unknown runs {unknown}; choose from {', '.join(RUNS)}.")
    return args


def verdicts(best: dict[str, float]) -> list[str]:
    """Issue 37's CPU targets: compile=True at most 1.02x the faster compiled loop (a DDP loop for "ddp"), never slower
    than phalanx eager."""
    lines = []
    for run, eager, prefix, what in (
        ("phalanx_compiled", "phalanx", "", "faster compiled loop"),
        ("ddp_compiled", "ddp", "ddp_", "faster compiled DDP loop"),
    ):
        loops = [
            best[f"{prefix}loop_compiled_{unit}"]
            for unit in ("model", "blocks")
            if f"{prefix}loop_compiled_{unit}" in best
        ]
        if run in best and loops:
            ratio = best[run] / min(loops)
            lines.append(f"{run} / {what}: {ratio:.3f} (target <= 1.02: {'met' if ratio <= 1.02 else 'missed'})")
        if run in best and eager in best:
            ratio = best[run] / best[eager]
            lines.append(f"{run} / {eager}: {ratio:.3f} (target <= 1.00: {'met' if ratio <= 1.0 else 'missed'})")
    return lines


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # ddp at world size 1 starts a one-process gloo group
    shape, names = SHAPES[args.shape], args.runs.split(",")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    began = time.perf_counter()
    for _ in range(args.rounds):
        for name in names:
            results[name].append(measure(name, shape, args))
    best = {name: min(result["ms"] for result in runs) for name, runs in results.items()}
    print(
        f"shape={args.shape} ({shape.layers} blocks, width {shape.width}, context {shape.context}, batch {shape.batch},"
        f" vocabulary {shape.vocab}) rounds={args.rounds} steps={args.steps} warmup={args.warmup}"
        f" threads={args.threads} backend={args.backend} clock={args.clock} torch={torch.__version__}"
        f" took {time.perf_counter() - began:.0f} s"
    )
    for name, runs in results.items():
        times = " ".join(f"{result['ms']:.2f}" for result in runs)
        print(
            f"{name:<24} best {best[name]:8.2f} ms/step  (rounds: {times})  graphs {runs[-1]['graphs']}"
            f"  graph breaks {runs[-1]['graph_breaks']}"
        )
    for line in verdicts(best):
        print(line)
    return best


if __name__ == "__main__":
    main()
