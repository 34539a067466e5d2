"""phalanx.Cohort on DDP against a hand-written DDP loop, both launched by torchrun on 2 CPU processes.

The same loop (MLP 32->256->256->1, SGD lr 0.01, batch 64 per process, one epoch of --steps steps over a
DistributedSampler(shuffle=True, seed=0), one thread per process) runs as plain torch DDP (bench/cohort/raw_ddp.py)
and through `phalanx.Cohort(strategy="ddp", devices=2)` (bench/cohort/cohort_ddp.py). Both are started with
`torchrun --nproc-per-node 2`, so the launcher is the same and the difference is phalanx's set-up and step overhead.
Figures: whole-job wall time (start of the command to its exit) and the steady-state time per step that rank 0
measures inside its loop (after 20 warm-up steps). Jobs alternate after one untimed warm-up of each; best and median of
--repeats are compared. Rank 0's final weights of both jobs must be bitwise equal. Target: per step, Cohort <= raw *
1.01 + 10 ms.

Usage: python bench/bench_cohort_ddp.py [--repeats 3] [--steps 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench_ddp import EXIT_ABORT, exit_aborts, free_port, run_job

HERE = Path(__file__).resolve().parent
SIDES = {"raw": "raw_ddp.py", "phalanx": "cohort_ddp.py"}


def job(side: str, out: Path, steps: int) -> tuple[float, dict]:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    elapsed = run_job(side, [*launcher, str(HERE / "cohort" / SIDES[side]), str(out), str(steps)])
    return elapsed, torch.load(out)


def summary(label: str, values: list[float], unit: str) -> str:
    shown = [round(v, 3) for v in values]
    return f"{label:<22} best {min(values):.3f} {unit}  median {statistics.median(values):.3f} {unit}  all {shown}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    job_s: dict[str, list[float]] = {"raw": [], "phalanx": []}
    step_ms: dict[str, list[float]] = {"raw": [], "phalanx": []}
    weights: dict[str, list[torch.Tensor]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in SIDES:  # warm-up: page cache and bytecode caches for both
            job(side, Path(tmp, f"{side}.pt"), 50)
        for _ in range(args.repeats):
            for side in SIDES:
                elapsed, result = job(side, Path(tmp, f"{side}.pt"), args.steps)
                job_s[side].append(elapsed)
                step_ms[side].append(result["step_ms"])
                weights[side] = result["weights"]
    same = len(weights["raw"]) == len(weights["phalanx"]) and all(
        torch.equal(a, b) for a, b in zip(weights["raw"], weights["phalanx"], strict=True)
    )
    print(f"steps={args.steps} repeats={args.repeats} processes=2 torch={torch.__version__} threads=1 per process")
    print(summary("torchrun + raw DDP", job_s["raw"], "s"))
    print(summary("torchrun + Cohort ddp", job_s["phalanx"], "s"))
    print(summary("raw DDP per step", step_ms["raw"], "ms"))
    print(summary("Cohort ddp per step", step_ms["phalanx"], "ms"))
    print(f"bitwise identical final weights on rank 0: {same}")
    print(
        f"jobs re-run after aborting at exit ({EXIT_ABORT!r}): raw {exit_aborts['raw']},"
        f" Cohort {exit_aborts['phalanx']}"
    )
    raw_step, cohort_step = statistics.median(step_ms["raw"]), statistics.median(step_ms["phalanx"])
    budget = raw_step * 1.01 + 10.0
    verdict = "met" if cohort_step <= budget else "NOT met"
    print(
        f"per step (median): Cohort {cohort_step:.3f} ms against raw {raw_step:.3f} ms,"
        f" ratio {cohort_step / raw_step:.3f}; target <= raw * 1.01 + 10 ms = {budget:.3f} ms: {verdict}"
    )
    print(
        f"job-time ratio (best/best): {min(job_s['phalanx']) / min(job_s['raw']):.3f}   (median/median:"
        f" {statistics.median(job_s['phalanx']) / statistics.median(job_s['raw']):.3f})"
    )


if __name__ == "__main__":
    main()
