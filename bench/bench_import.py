"""Extra start-up time of `import phalanx` over `import torch`.

Each measurement is a fresh interpreter (imports are cached within one), alternating the two commands so that
machine noise hits both alike; the medians are compared. Usage: python bench/bench_import.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

# phalanx's public names load lazily, so the fair figure is the import of what a training script uses, plus the
# callbacks and loggers that constructing a Trainer loads.
_PHALANX = (
    "from phalanx import Trainer, TrainingModule, DataModule, Callback, seed_everything; import"
    " phalanx.callbacks, phalanx.loggers"
)
_TIMED = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"


def time_import(statement: str) -> float:
    output = subprocess.run(
        [sys.executable, "-c", _TIMED.format(statement=statement)], capture_output=True, text=True, check=True
    )
    return float(output.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    time_import(_PHALANX)  # warm the file cache
    torch_times, phalanx_times = [], []
    for _ in range(args.repeats):
        torch_times.append(time_import("import torch"))
        phalanx_times.append(time_import(_PHALANX))
    torch_median, phalanx_median = statistics.median(torch_times), statistics.median(phalanx_times)
    print(f"repeats={args.repeats}")
    print(f"import torch    median {torch_median:.3f} s")
    print(f"phalanx public API  median {phalanx_median:.3f} s  (includes torch; {_PHALANX!r})")
    print(f"import overhead of phalanx over torch: {phalanx_median - torch_median:.3f} s  target <= 0.3 s")


if __name__ == "__main__":
    main()
