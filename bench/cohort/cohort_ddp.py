"""The same loop on phalanx.Cohort(strategy="ddp"), launched by torchrun; rank 0 saves weights and time per step.

Usage: torchrun --nproc-per-node 2 bench/cohort/cohort_ddp.py OUT.pt STEPS
"""

import sys

import torch

torch.set_num_threads(1)

from common import BATCH, make_dataset, make_model, timed_loop  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import phalanx  # noqa: E402


def train(cohort: phalanx.Cohort, out: str, steps: int) -> None:
    module = make_model()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.01))
    # shuffle=True becomes DistributedSampler(shuffle=True, seed=0), as in the raw script
    loader = cohort.setup_dataloaders(
        DataLoader(make_dataset(steps, cohort.world_size), batch_size=BATCH, shuffle=True)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        cohort.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()

    timing = timed_loop(loader, step)
    if cohort.is_global_zero:
        torch.save({"weights": [p.detach() for p in module.parameters()], **timing}, out)


if __name__ == "__main__":
    cohort = phalanx.Cohort(accelerator="cpu", strategy="ddp", devices=2)
    cohort.launch(train, sys.argv[1], int(sys.argv[2]))
