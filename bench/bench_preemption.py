"""What preemption handling costs per training step (bench/preemption/job.py, the training loop timed alone).

One process: handling on (a flag read every step) against off. Two DDP processes on the CPU: off, agreement every
10 steps (the default: one tiny all-reduce per 10 steps) and every step. Modes alternate; medians are compared.
Usage: python bench/bench_preemption.py [--repeats 3] [--steps 1000]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "preemption" / "job.py"


def us_per_step(devices: int, steps: int, mode: str) -> float:
    output = subprocess.run(
        [sys.executable, str(JOB), str(devices), str(steps), mode], capture_output=True, text=True, check=True
    ).stdout
    return float(re.search(r"us_per_step=([\d.]+)", output).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    for devices, modes in ((1, ("off", "k1")), (2, ("off", "k10", "k1"))):
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                times[mode].append(us_per_step(devices, args.steps, mode))
        base = statistics.median(times["off"])
        print(f"{devices} process(es), {args.steps} steps, MLP 32->256->256->1, batch 64 per process:")
        for mode in modes:
            median = statistics.median(times[mode])
            print(
                f"  {mode:>4}: median {median:8.1f} us/step  ratio to off {median / base:.3f}  (runs:"
                f" {', '.join(f'{t:.0f}' for t in times[mode])})"
            )


if __name__ == "__main__":
    main()
