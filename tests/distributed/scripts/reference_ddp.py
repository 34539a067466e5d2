"""The same 50 steps written with plain torch.distributed and DistributedDataParallel. Usage: python reference_ddp.py
OUT.pt"""

import os
import sys
import time

import torch
import torch.distributed as dist
from ddp_common import IndexedRegression
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def worker(rank: int, world_size: int, out: str, port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    dataset = IndexedRegression(n=800)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    for step, (x, y, _) in enumerate(DataLoader(dataset, batch_size=8, sampler=sampler)):
        if step == 50:
            break
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    # Plain torch 2.13 sometimes aborts a finished gloo job at exit ("terminate called without an active exception",
    # pytorch/pytorch#190489); give gloo's worker threads the moment phalanx gives them (utilities/process_group_exit).
    del ddp
    time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    torch.multiprocessing.spawn(worker, args=(2, sys.argv[1], port), nprocs=2)
