"""Per-rank memory of FSDP on 2 CPU processes against ZeRO's predictions (bench/fsdp/job.py measures, this prints).

For Adam in float32 a model of P parameter bytes needs P (parameters) + P (gradients) + 2P (two moments) in one
process. ZeRO-3 (FULL_SHARD) predicts 4P/N per rank; ZeRO-2 (SHARD_GRAD_OP) keeps whole parameters while a step
runs, P + 3P/N; NO_SHARD (replication, DDP-like) keeps 4P. The ratio printed is measured / predicted.
Usage: python bench/bench_fsdp_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).parent / "fsdp" / "job.py"
WORLD = 2


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "figures.json"
        subprocess.run([sys.executable, str(JOB), str(out)], check=True)
        figures = json.loads(out.read_text())
    total = figures["total_parameter_bytes"]
    predictions = {
        "FULL_SHARD": {"parameters": total / WORLD, "gradients": total / WORLD, "optimizer": 2 * total / WORLD},
        "SHARD_GRAD_OP": {
            "parameters": total + total / WORLD,
            "gradients": total / WORLD,
            "optimizer": 2 * total / WORLD,
        },
        "NO_SHARD": {"parameters": total, "gradients": total, "optimizer": 2 * total},
    }
    print(
        f"model: {total / 2**20:.2f} MiB of float32 parameters; one process with Adam holds {4 * total / 2**20:.2f} MiB"
    )
    print(
        f"{'sharding':<14} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'adam MiB':>9} {'sum MiB':>8}"
        f" {'predicted':>10} {'ratio':>6}"
    )
    for sharding, prediction in predictions.items():
        for rank, measured in enumerate(figures[sharding]):
            held = measured["parameters"] + measured["gradients"] + measured["optimizer"]
            expected = sum(prediction.values())
            print(
                f"{sharding:<14} {rank:>4} {measured['parameters'] / 2**20:>11.2f}"
                f" {measured['gradients'] / 2**20:>10.2f} {measured['optimizer'] / 2**20:>9.2f}"
                f" {held / 2**20:>8.2f} {expected / 2**20:>10.2f} {held / expected:>6.3f}"
            )


if __name__ == "__main__":
    main()
