"""A Fabric-style loop on one process, saved mid-epoch and resumed by a new Cohort, goes on as the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

BATCHES_PER_EPOCH = 6
TOTAL_STEPS = 15


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES_PER_EPOCH * 4, 3, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=generator))


def _run(save_at: int | None, resume_from: str | None, path: str) -> list[torch.Tensor]:
    """The usual resume loop: set up, load if resuming, then skip the epochs and batches already done."""
    phalanx.seed_everything(0)
    cohort = phalanx.Cohort(strategy="single_device", accelerator="cpu", devices=1)
    module = nn.Linear(3, 1)
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    loader = cohort.setup_dataloaders(DataLoader(_dataset(), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume_from is not None:
        cohort.load(resume_from, state)
    step = state["step"]
    epoch, skip = divmod(step, len(loader))
    loader.set_epoch(epoch)
    while step < TOTAL_STEPS:
        for index, (x, y) in enumerate(loader):
            if index < skip:
                continue
            optimizer.zero_grad()
            cohort.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            step += 1
            if step == save_at:
                cohort.save(path, {"model": model, "optimizer": optimizer, "step": step})
            if step == TOTAL_STEPS:
                break
        skip = 0
    return [parameter.detach().clone() for parameter in module.parameters()]


@pytest.mark.parametrize("save_at", [2, BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 3])
def test_single_device_shuffled_loop_resumes_exactly(tmp_path, save_at):
    path = str(tmp_path / "mid.ckpt")
    uninterrupted = _run(save_at, None, path)
    resumed = _run(None, path, path)
    for expected, actual in zip(uninterrupted, resumed):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_loader_with_its_own_generator_keeps_its_sampler():
    cohort = phalanx.Cohort(strategy="single_device", accelerator="cpu", devices=1)
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True, generator=generator)
    prepared = cohort.setup_dataloaders(loader)
    assert prepared._dataloader.sampler is loader.sampler
