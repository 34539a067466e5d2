"""How long one checkpoint save blocks the training loop: synchronous (TorchCheckpointIO) against AsyncCheckpointIO,
for a model of 256 MiB of float32 weights on CPU.

- one process, one file (what single_device, ddp and FSDP 'full' write): ``save_checkpoint``;
- FSDP (``fully_shard``) on 2 processes (gloo), the sharded DCP layout: ``save_sharded_checkpoint``, every rank.

Blocking = the time the save call takes to return (the async IO has then staged a copy of the tensors); the async
write's total time (until published) is printed too. Each figure is the median of ``--repeats`` saves after a first
one (timed apart), into a temporary directory on this machine's disk. Target: async blocking <= 10% of sync.
Usage: python bench/bench_async_checkpoint.py [--repeats 3] [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


def model(mib: int) -> nn.Module:
    width = 2048
    layers = max(1, mib * 2**20 // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def timed(save: Callable[[int], Any], finish: Callable[[], None], repeats: int) -> tuple[float, float, float]:
    """(median time a save call blocked, median time until its write finished, the first save's blocking time).

    The first save is timed apart: AsyncCheckpointIO allocates its staging buffers then (later saves reuse them).
    """
    blocked, total = [], []
    for index in range(repeats + 1):
        start = time.perf_counter()
        save(index)
        blocked.append(time.perf_counter() - start)
        finish()
        total.append(time.perf_counter() - start)
    return statistics.median(blocked[1:]), statistics.median(total[1:]), blocked[0]


def report(label: str, sync: tuple[float, float, float], asynchronous: tuple[float, float, float]) -> None:
    ratio = asynchronous[0] / sync[0]
    print(
        f"{label:<26} sync blocks {sync[0]:6.3f} s | async blocks {asynchronous[0]:6.3f} s (first save"
        f" {asynchronous[2]:6.3f} s; written after {asynchronous[1]:6.3f} s) | async/sync {ratio:6.1%}"
        f" {'OK' if ratio <= 0.10 else 'OVER 10%'}"
    )


def one_file(mib: int, repeats: int, directory: Path) -> None:
    from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    checkpoint = {"state_dict": model(mib).state_dict(), "global_step": 1}
    sync_io, async_io = TorchCheckpointIO(), AsyncCheckpointIO()
    sync = timed(lambda i: sync_io.save_checkpoint(checkpoint, directory / f"sync{i}.ckpt"), lambda: None, repeats)
    asynchronous = timed(
        lambda i: async_io.save_checkpoint(checkpoint, directory / f"async{i}.ckpt"), async_io.wait, repeats
    )
    async_io.teardown()
    report("1 process, one file", sync, asynchronous)


def _fsdp_rank(rank: int, mib: int, repeats: int, directory: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from phalanx.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from phalanx.plugins.io.collectives import Collectives

    warnings.filterwarnings("ignore")
    # One thread per rank, as torchrun sets (OMP_NUM_THREADS=1): two ranks with a thread per core each oversubscribe
    # the machine and make every copy, synchronous or not, slower by a random amount.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    module = model(mib)
    for layer in module:
        fully_shard(layer)
    fully_shard(module)
    checkpoint = {"state_dict": module.state_dict(), "global_step": 1}

    def broadcast(obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    collectives = Collectives(rank=rank, world_size=2, broadcast=broadcast, barrier=lambda name=None: dist.barrier())
    sync_io, async_io = TorchCheckpointIO(), AsyncCheckpointIO()
    root = Path(directory)
    sync = timed(
        lambda i: sync_io.save_sharded_checkpoint(checkpoint, root / f"sync{i}.ckpt", collectives=collectives),
        dist.barrier,
        repeats,
    )
    asynchronous = timed(
        lambda i: async_io.save_sharded_checkpoint(checkpoint, root / f"async{i}.ckpt", collectives=collectives),
        lambda: (async_io.wait(), dist.barrier()),
        repeats,
    )
    async_io.teardown()
    if rank == 0:
        report("FSDP 2 processes, sharded", sync, asynchronous)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"model: {args.mib} MiB of float32 weights; {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as directory:
        one_file(args.mib, args.repeats, Path(directory))
    with tempfile.TemporaryDirectory() as directory:
        import torch.multiprocessing as mp

        port = 29500 + os.getpid() % 1000
        mp.spawn(_fsdp_rank, args=(args.mib, args.repeats, directory, port), nprocs=2, join=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
