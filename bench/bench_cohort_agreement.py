"""What the Cohort's agreement on collective calls costs per call, and what it leaves in the store (issue 33, item 14).

For each world size, CPU processes (gloo) make CALLS agreements each (bench/cohort/agreement_job.py: the store round
alone, as ``save``, ``load``, ``broadcast`` and ``barrier`` make one before their collective). Printed per world size:
microseconds per call (median of 5 blocks), store operations per call on each rank, and the store's keys before and
after. ``--tree`` runs the job against another checkout (e.g. a ``git archive`` of an earlier commit) for a before and
after. Usage: python bench/bench_cohort_agreement.py [--world-sizes 2 4] [--calls 10000] [--tree PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "cohort" / "agreement_job.py"


def run(world_size: int, calls: int, tree: Path) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    environment["PYTHONPATH"] = os.pathsep.join([str(tree), environment.get("PYTHONPATH", "")])
    output = subprocess.run(
        [sys.executable, str(JOB), str(world_size), str(calls)],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        timeout=3600,
    ).stdout
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="the phalanx checkout")
    args = parser.parse_args()
    print(f"tree {args.tree}, {args.calls} agreements per rank:")
    for world_size in args.world_sizes:
        result = run(world_size, args.calls, args.tree)
        operations = ", ".join(f"{count:g}" for count in result["store_ops_per_call"])
        print(
            f"  world {world_size}: {result['us_per_call']:.1f} us/call | store operations per call, by rank:"
            f" {operations} (rank 0: {result['by_operation']}) | keys {result['keys_before']} ->"
            f" {result['keys_after']}"
        )


if __name__ == "__main__":
    main()
