"""FSDP sharded checkpoints on 2 CPU processes (gloo): TorchCheckpointIO's sharded save and load against plain
``torch.distributed.checkpoint.save`` / ``load`` of the same state dict.

A model of ``--mib`` MiB of float32 weights (``Linear(2048, 2048)`` layers, each ``fully_shard``-ed), one torch
thread per rank (as under torchrun). Both sides write with DCP's file system writer (which fsyncs its files); phalanx
adds its meta file, the ``.complete`` marker and the atomic publish. Rounds are interleaved, each figure the best of
``--repeats``, timed on rank 0 between barriers, with rank 0's peak resident memory (``VmHWM``) above its resident
memory before each operation (its model already built).
Usage: python bench/bench_sharded_checkpoint.py [--mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))


def _rank(rank: int, mib: int, repeats: int, directory: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from phalanx.plugins.io import TorchCheckpointIO
    from phalanx.plugins.io.collectives import Collectives

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    width = 2048
    module = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, mib * 2**20 // (4 * width**2)))])
    for layer in module:
        fully_shard(layer)
    fully_shard(module)

    def broadcast(obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    collectives = Collectives(rank=rank, world_size=2, broadcast=broadcast, barrier=lambda name=None: dist.barrier())
    io = TorchCheckpointIO()
    root = Path(directory)
    state = module.state_dict()

    peaks: dict[str, int] = {}

    def timed(name: str, step: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as handle:  # VmHWM starts again from the current resident size
            handle.write("5")
        before = _status("VmRSS")
        start = time.perf_counter()
        step(*args, **kwargs)
        dist.barrier()
        seconds = time.perf_counter() - start
        peaks[name] = max(peaks.get(name, 0), _status("VmHWM") - before)
        return seconds

    best: dict[str, float] = {}
    for index in range(repeats):
        plain, ours = str(root / f"dcp{index}"), root / f"phalanx{index}.ckpt"
        figures = {
            "dcp.save": timed("dcp.save", dcp.save, state, checkpoint_id=plain),
            "phalanx save": timed(
                "phalanx save",
                io.save_sharded_checkpoint,
                {"state_dict": state, "global_step": 1},
                ours,
                collectives=collectives,
            ),
            "dcp.load": timed("dcp.load", dcp.load, module.state_dict(), checkpoint_id=plain),
            "phalanx load": timed(
                "phalanx load", io.load_sharded_checkpoint, ours, module_state=module.state_dict(), optimizers=[]
            ),
        }
        for name, seconds in figures.items():
            best[name] = min(best.get(name, seconds), seconds)
    if rank == 0:
        for operation in ("save", "load"):
            torch_s, phalanx_s = best[f"dcp.{operation}"], best[f"phalanx {operation}"]
            peak = f"{peaks[f'dcp.{operation}'] / 2**20:+.0f} / {peaks[f'phalanx {operation}'] / 2**20:+.0f} MiB"
            print(
                f"{operation}: dcp {torch_s:.3f} s | phalanx {phalanx_s:.3f} s | ratio {phalanx_s / torch_s:.2f}"
                f" | rank 0's peak memory above its state, dcp / phalanx: {peak}"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.mib} MiB model, 2 ranks, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        import torch.multiprocessing as mp

        port = 29500 + os.getpid() % 1000
        mp.spawn(_rank, args=(args.mib, args.repeats, directory, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
