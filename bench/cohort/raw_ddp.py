"""Hand-written DDP loop, the baseline of bench/bench_cohort_ddp.py; rank 0 saves weights and its time per step.

Usage: torchrun --nproc-per-node 2 bench/cohort/raw_ddp.py OUT.pt STEPS
"""

import sys
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from common import BATCH, make_dataset, make_model, timed_loop  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402


def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    dataset = make_dataset(steps, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()

    timing = timed_loop(DataLoader(dataset, batch_size=BATCH, sampler=sampler), step)
    if rank == 0:
        torch.save({"weights": [p.detach() for p in model.parameters()], **timing}, out)
    time.sleep(0.1)  # lets gloo's worker threads finish before exit (pytorch/pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
