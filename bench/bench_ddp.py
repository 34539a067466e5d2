"""phalanx DDP on 2 CPU processes against a hand-written DDP script launched with torchrun: whole-job wall time.

Both jobs train the same MLP 32->256->256->1 (ReLU) from the same seed with SGD lr 0.01, batch 64 per process, for
--steps steps (one epoch of a TensorDataset of 2*64*steps random samples, sharded by a DistributedSampler with
shuffle and seed 0), one thread per process. The figure is the time from starting the command to its exit, measured
here around subprocess.run: interpreter start-up, imports, process-group set-up, training and teardown, i.e. what
a user waits for. Jobs alternate (after one untimed warm-up of each); best and median of --repeats are compared.
Both jobs save rank 0's final weights, which must be identical.

A job that dies at exit with "terminate called without an active exception" (a gloo worker thread needing the GIL
while the interpreter shuts down, see pytorch/pytorch#190489 and phalanx/utilities/process_group_exit.py, which keeps
phalanx's own jobs clear of it; the raw script can still hit it) is run again, and the count of such jobs is printed;
any other failure stops the benchmark.

  phalanx:  python bench/ddp/phalanx_ddp.py OUT.pt STEPS
  raw:      python -m torch.distributed.run --nproc-per-node 2 --master-port PORT bench/ddp/raw_ddp.py OUT.pt STEPS

Usage: python bench/bench_ddp.py [--repeats 3] [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EXIT_ABORT = "terminate called without an active exception"
exit_aborts = {"raw": 0, "phalanx": 0}


def run_job(side: str, command: list[str]) -> float:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    for _ in range(3):
        start = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if result.returncode == 0:
            return elapsed
        if EXIT_ABORT not in result.stderr:
            break
        exit_aborts[side] += 1
    sys.exit(f"{' '.join(command)} failed with status {result.returncode}:\n{result.stdout}{result.stderr}")


def raw_job(out: Path, steps: int) -> float:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    return run_job("raw", [*launcher, str(HERE / "ddp" / "raw_ddp.py"), str(out), str(steps)])


def phalanx_job(out: Path, steps: int) -> float:
    return run_job("phalanx", [sys.executable, str(HERE / "ddp" / "phalanx_ddp.py"), str(out), str(steps)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw_out, phalanx_out = Path(tmp, "raw.pt"), Path(tmp, "phalanx.pt")
        raw_job(raw_out, 50)  # warm-up: page cache and bytecode caches for both
        phalanx_job(phalanx_out, 50)
        raw_times, phalanx_times = [], []
        for _ in range(args.repeats):
            raw_times.append(raw_job(raw_out, args.steps))
            phalanx_times.append(phalanx_job(phalanx_out, args.steps))
        raw_weights, phalanx_weights = torch.load(raw_out), torch.load(phalanx_out)
    same = len(raw_weights) == len(phalanx_weights) and all(
        torch.equal(a, b) for a, b in zip(raw_weights, phalanx_weights)
    )
    best_raw, best_phalanx = min(raw_times), min(phalanx_times)
    median_raw, median_phalanx = statistics.median(raw_times), statistics.median(phalanx_times)
    print(f"steps={args.steps} repeats={args.repeats} processes=2 torch={torch.__version__} threads=1 per process")
    print(
        f"torchrun + raw DDP  best {best_raw:.3f} s  median {median_raw:.3f} s  all {[round(t, 3) for t in raw_times]}"
    )
    print(
        f"phalanx ddp         best {best_phalanx:.3f} s  median {median_phalanx:.3f} s  all"
        f" {[round(t, 3) for t in phalanx_times]}"
    )
    print(f"identical final weights on rank 0: {same}")
    if not same:
        diff = max((a - b).abs().max().item() for a, b in zip(raw_weights, phalanx_weights))
        print(f"  largest absolute difference: {diff:.3e}")
    print(
        f"jobs re-run after aborting at exit ({EXIT_ABORT!r}): raw {exit_aborts['raw']}, phalanx"
        f" {exit_aborts['phalanx']}"
    )
    print(
        f"job-time ratio (best/best): {best_phalanx / best_raw:.3f}   (median/median:"
        f" {median_phalanx / median_raw:.3f})  target <= 1.15"
    )


if __name__ == "__main__":
    main()
