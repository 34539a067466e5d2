"""Hand-written DDP training, the baseline of bench/bench_ddp.py; rank 0 saves its final weights.

Usage: torchrun --nproc-per-node 2 bench/ddp/raw_ddp.py OUT.pt STEPS
"""

import sys
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

BATCH = 64


def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    n = 2 * BATCH * steps
    dataset = TensorDataset(torch.randn(n, 32, generator=generator), torch.randn(n, 1, generator=generator))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    for x, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    time.sleep(0.1)  # lets gloo's worker threads finish before exit (pytorch/pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
