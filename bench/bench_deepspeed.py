"""Per-rank memory of DeepSpeed ZeRO stages 1-3 on 2 CPU processes against ZeRO's predictions (and DDP's figures).

bench/deepspeed/job.py trains four Linear(1024, 1024) layers with Adam under DDP and DeepSpeed stages 1-3 (float32
and bf16-mixed) and each rank reports the bytes it holds once training ends (``DeepSpeedStrategy.memory_footprint``:
its parameter shards plus any parameter kept whole, and the optimizer states: Adam's two moments plus the float32
master weights DeepSpeed keeps for the optimizer). With P parameters, N processes and the ZeRO paper's K = 12 bytes
of optimizer state per parameter (float32 master copy + two float32 moments):

  DDP (float32):          parameters 4P,          optimizer states 8P (moments only: the optimizer steps the weights)
  stages 1 and 2:         parameters 4P (2P bf16), optimizer states 12P/N
  stage 3:                parameters 4P/N (2P/N),  optimizer states 12P/N

ZeRO-3 keeps tensors under 100k elements (stage3_param_persistence_threshold; here the four biases) whole on every
rank, so it holds slightly more than 4P/N. The ratio printed is measured / predicted; seconds per step (after two
warm-up steps, one thread per process) are for information.

Usage: python bench/bench_deepspeed.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).parent / "deepspeed" / "job.py"
MIB = 2**20


def predictions(strategy: str, precision: str, parameters: int, world: int) -> tuple[float, float]:
    weight_bytes = 2 if precision.startswith("bf16") else 4
    if strategy == "ddp":
        return weight_bytes * parameters, 8 * parameters
    shards = world if strategy.endswith("3") else 1
    return weight_bytes * parameters / shards, 12 * parameters / world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    steps = parser.parse_args().steps
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run(
            [sys.executable, str(JOB), directory, str(steps)],
            check=True,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ranks = [json.loads((Path(directory) / f"rank{rank}.json").read_text()) for rank in range(2)]
    parameters, world = ranks[0]["parameters"], ranks[0]["world_size"]
    print(f"model: {parameters:,} parameters ({4 * parameters / MIB:.2f} MiB float32), Adam, {world} processes")
    header = (
        f"{'strategy':<18} {'precision':<10} {'rank':>4} {'params MiB':>10} {'pred':>7} {'ratio':>6}"
        f" {'optim MiB':>9} {'(master)':>8} {'pred':>7} {'ratio':>6} {'ms/step':>8}"
    )
    print(header)
    for run in (key for key in ranks[0] if " " in key):
        strategy, precision = run.split(" ")
        predicted_parameters, predicted_states = predictions(strategy, precision, parameters, world)
        for rank, figures in enumerate(ranks):
            measured = figures[run]
            print(
                f"{strategy:<18} {precision:<10} {rank:>4} {measured['parameters'] / MIB:>10.2f}"
                f" {predicted_parameters / MIB:>7.2f}"
                f" {measured['parameters'] / predicted_parameters:>6.3f} {measured['optimizer_states'] / MIB:>9.2f}"
                f" {measured['master_weights'] / MIB:>8.2f} {predicted_states / MIB:>7.2f}"
                f" {measured['optimizer_states'] / predicted_states:>6.3f}"
                f" {1000 * measured['seconds_per_step']:>8.1f}"
            )


if __name__ == "__main__":
    main()
