"""How often a finished DDP job dies at exit with "terminate called without an active exception", with and without
the pause phalanx takes before destroying the process group (phalanx/utilities/process_group_exit.py).

Runs --jobs short 2-process jobs of each kind, alternating, and prints the count of jobs that failed and of those
that aborted at exit. No timing: the figure is a failure rate.

  python bench/bench_exit_aborts.py --jobs 60
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "exit" / "job.py"
EXIT_ABORT = "terminate called without an active exception"


def run(mode: str) -> tuple[bool, bool]:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, str(JOB), mode], env=env, capture_output=True, text=True)
    return result.returncode != 0, EXIT_ABORT in result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=60, help="jobs of each kind")
    args = parser.parse_args()
    counts = {mode: [0, 0] for mode in ("no-drain", "drain")}
    for _ in range(args.jobs):
        for mode, tally in counts.items():
            failed, aborted = run(mode)
            tally[0] += failed
            tally[1] += aborted
    for mode, (failed, aborted) in counts.items():
        print(
            f"{mode:9s}: {args.jobs} jobs, {failed} failed, {aborted} aborted at exit"
            f" ({100 * aborted / args.jobs:.1f}%)"
        )


if __name__ == "__main__":
    main()
