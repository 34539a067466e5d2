"""One-file checkpoints against torch: save and load time and peak memory, TorchCheckpointIO against torch.save and
torch.load(weights_only=True), and how long AsyncCheckpointIO's save blocks.

The state is ``--gib`` GiB of float32 (16 tensors), and 4 GiB too with ``--four``. Every measurement runs in a fresh
child process, so that its peak resident memory (``VmHWM``) is its own: "peak above" is that peak minus the resident
memory just before the operation (for a load: minus the state's size too, which a load must allocate). Saves are
followed by an fsync of the file on both sides (phalanx's save does it itself). Loads read a file that was just
written (from the page cache on both sides). Rounds are interleaved, each pair's order swapped every other round, the
file system synced before each operation and each save's file removed after it; each figure is the best of
``--repeats``.
``--tree DIR`` measures phalanx from another checkout too (an A/B against an older commit).
Usage: python bench/bench_checkpoint_io.py [--gib 1] [--four] [--repeats 3] [--tree /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import torch
from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

op, gib, directory = sys.argv[1], float(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)


def status(field):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:  # VmHWM starts again from the current resident size
        handle.write("5")


def state():
    numel = int(gib * (1 << 30)) // 4 // 16
    return {"global_step": 1, "state_dict": {f"w{i}": torch.full((numel,), float(i)) for i in range(16)}}


path = os.path.join(directory, "state.ckpt")
result = {}
if op in ("torch.save", "phalanx save", "async"):
    checkpoint = state()
    target = os.path.join(directory, f"{op.replace(' ', '_')}.ckpt")
    reset_peak()
    before = status("VmRSS")
    start = time.perf_counter()
    if op == "torch.save":
        torch.save(checkpoint, target)
        with open(target, "rb+") as handle:
            os.fsync(handle.fileno())
    elif op == "phalanx save":
        TorchCheckpointIO().save_checkpoint(checkpoint, target)
    else:
        io = AsyncCheckpointIO()
        io.save_checkpoint(checkpoint, target)  # the first save allocates the staging buffers
        io.wait()
        start = time.perf_counter()
        io.save_checkpoint(checkpoint, target)
        result["blocked"] = time.perf_counter() - start
        io.teardown()
    result["seconds"] = time.perf_counter() - start
    result["peak_above"] = status("VmHWM") - before
else:
    size = os.path.getsize(path)
    reset_peak()
    before, anonymous = status("VmRSS"), status("RssAnon")
    start = time.perf_counter()
    if op == "torch.load":
        loaded = torch.load(path, weights_only=True)
    elif op == "phalanx load":
        loaded = TorchCheckpointIO().load_checkpoint(path)
    else:  # lazy: mapped, then every tensor read once
        loaded = TorchCheckpointIO().load_checkpoint(path, mmap=True)
    result["seconds"] = time.perf_counter() - start
    if op == "lazy load + sum":
        total = sum(float(t.sum()) for t in loaded["state_dict"].values())
        result["seconds_with_sum"] = time.perf_counter() - start
        expected = sum(float(i) for i in range(16)) * loaded["state_dict"]["w0"].numel()
        assert total == expected, (total, expected)  # every byte was read
        # The mapped pages count in VmHWM but are the file's page cache: what the load allocated is anonymous memory.
        result["anonymous"] = status("RssAnon") - anonymous
    result["peak_above"] = status("VmHWM") - before - (0 if op == "lazy load + sum" else size)
print("RESULT " + json.dumps(result))
"""

OPS = ["torch.save", "phalanx save", "torch.load", "phalanx load", "lazy load + sum", "async"]


def run(op: str, gib: float, directory: str, tree: Path) -> dict[str, float]:
    environment = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, op, str(gib), directory],
        capture_output=True,
        text=True,
        env=environment,
        cwd=directory,  # "-c" puts the working directory first on sys.path: it must not hold another phalanx
    )
    line = next((line for line in child.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{op} failed:\n{child.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def measure(gib: float, repeats: int, trees: dict[str, Path]) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        # The file every load reads, written by the phalanx under test (identical bytes to torch.save's).
        run("phalanx save", gib, directory, ROOT)
        os.replace(os.path.join(directory, "phalanx_save.ckpt"), os.path.join(directory, "state.ckpt"))
        for round_ in range(repeats):
            # Every other round runs the pairs in the opposite order, so that neither side always follows the other's
            # disk traffic; each save's file is removed after it, and dirty pages are flushed before each operation.
            for op in OPS if round_ % 2 == 0 else _swapped_pairs(OPS):
                for name, tree in trees.items():
                    if (op.startswith("torch") or op.startswith("lazy")) and name != "this tree":
                        continue  # torch's figures once; an older phalanx may have no lazy load
                    os.sync()
                    results.setdefault(f"{op} ({name})", []).append(run(op, gib, directory, tree))
                    for written in Path(directory).glob("*.ckpt"):
                        if written.name != "state.ckpt":
                            written.unlink()
    return results


def _swapped_pairs(ops: list[str]) -> list[str]:
    """``ops`` with each (torch, phalanx) pair in the other order."""
    swapped = list(ops)
    for first in range(0, 4, 2):
        swapped[first], swapped[first + 1] = swapped[first + 1], swapped[first]
    return swapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--four", action="store_true", help="also measure a 4 GiB state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=None, help="another checkout of phalanx to measure as well")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.tree is not None:
        trees["other tree"] = args.tree.resolve()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}")
    for gib in [args.gib] + ([4.0] if args.four else []):
        results = measure(gib, args.repeats, trees)
        print(f"\n{gib:g} GiB state, best of {args.repeats} (seconds; peak memory above the state, GiB)")
        for label, runs in results.items():
            best = min(runs, key=lambda r: r.get("blocked", r["seconds"]))
            extra = f" | blocked {best['blocked']:.3f} s" if "blocked" in best else ""
            if "seconds_with_sum" in best:
                extra += f" | with reading every tensor {best['seconds_with_sum']:.3f} s"
                extra += f" | anonymous memory {max(r['anonymous'] for r in runs) / (1 << 30):+.2f} GiB"
            peak = max(r["peak_above"] for r in runs) / (1 << 30)
            print(f"{label:<34} {best['seconds']:7.3f} s | peak above {peak:+.2f} GiB{extra}")


if __name__ == "__main__":
    main()
