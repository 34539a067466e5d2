"""Extra start-up time of `import phalanx` over `import torch`.

Each measurement is a fresh interpreter (imports are cached within one), alternating the two commands so that
machine noise hits both alike; the medians are compared. Usage: python bench/bench_import.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_TIMED = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def time_import(module: str) -> float:
    output = subprocess.run([sys.executable, "-c", _TIMED.format(module=module)], capture_output=True, text=True, check=True)
    return float(output.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    time_import("phalanx")  # warm the file cache
    torch_times, phalanx_times = [], []
    for _ in range(args.repeats):
        torch_times.append(time_import("torch"))
        phalanx_times.append(time_import("phalanx"))
    torch_median, phalanx_median = statistics.median(torch_times), statistics.median(phalanx_times)
    print(f"repeats={args.repeats}")
    print(f"import torch    median {torch_median:.3f} s")
    print(f"import phalanx  median {phalanx_median:.3f} s  (includes torch)")
    print(f"import overhead of phalanx over torch: {phalanx_median - torch_median:.3f} s  target <= 0.3 s")


if __name__ == "__main__":
    main()
