"""One 2-process CPU job for bench/bench_deepspeed.py: per-rank bytes (and step time) under DDP and ZeRO stages 1-3.

Usage: python bench/deepspeed/job.py OUT_DIR [STEPS]   (phalanx starts the second process itself; DS_ACCELERATOR=cpu)
Every rank writes OUT_DIR/rank{R}.json: for each (strategy, precision), the bytes it holds after training.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

WIDTH, DEPTH = 1024, 4  # four 1M-element weight matrices: 16 MiB of float32 parameters, as in bench_fsdp_memory.py
RUNS = [
    ("ddp", "32-true"),
    ("deepspeed_stage_1", "32-true"),
    ("deepspeed_stage_2", "32-true"),
    ("deepspeed_stage_3", "32-true"),
    ("deepspeed_stage_1", "bf16-mixed"),
    ("deepspeed_stage_2", "bf16-mixed"),
    ("deepspeed_stage_3", "bf16-mixed"),
]


class Model(phalanx.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layers is None:  # under ZeRO-3 the layers are partitioned as they are created
            self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Probe(phalanx.Callback):
    """Bytes this rank holds once training ends, and the time per step after two warm-up steps."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self._start = time.perf_counter()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.figures["seconds_per_step"] = (time.perf_counter() - self._start) / (trainer.global_step - 2)
        strategy = trainer.strategy
        if hasattr(strategy, "memory_footprint"):
            self.figures.update({key: float(value) for key, value in strategy.memory_footprint().items()})
        else:  # DDP: the whole model and Adam's two moments in every process
            optimizer = trainer.optimizers[0]
            states = [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
            self.figures["parameters"] = float(sum(p.nbytes for p in module.parameters()))
            self.figures["optimizer_states"] = float(sum(v.nbytes for v in states))
            self.figures["master_weights"] = 0.0


def main() -> None:
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"parameters": WIDTH * WIDTH * DEPTH + WIDTH * DEPTH, "world_size": 2}
    data = DataLoader(TensorDataset(torch.randn(2 * 16 * steps, WIDTH)), batch_size=16)
    for strategy, precision in RUNS:
        phalanx.seed_everything(0)
        probe = Probe()
        trainer = phalanx.Trainer(
            strategy=strategy, precision=precision, accelerator="cpu", devices=2, max_steps=steps, callbacks=[probe],
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(Model(), data)
        results[f"{strategy} {precision}"] = probe.figures
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
