"""The validation sanity check draws nothing that training sees (Lightning isolates it the same way): a fit with the
check shuffles, draws and initialises exactly as the same fit without it, whatever the validation code draws."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.utilities.seed import collect_rng_states, isolate_rng


def _validation_draws(kind: str) -> None:
    if kind == "torch":
        torch.rand(3)
    elif kind == "python":
        random.random()
    elif kind == "numpy":
        np.random.rand(2)


class Recorder(phalanx.TrainingModule):
    def __init__(self, validation_draws: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.validation_draws = validation_draws
        self.seen: list[list[float]] = []
        self.draws: list[tuple[float, float, float]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())
        self.draws.append((torch.rand(()).item(), random.random(), float(np.random.rand())))
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        _validation_draws(self.validation_draws)
        self.log("val_loss", self.layer(batch[0]).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, sanity_steps: int, validation_draws: str, val_shuffle: bool, workers: int):
    phalanx.seed_everything(7)
    data = TensorDataset(torch.arange(24.0).reshape(12, 2), torch.zeros(12))
    module = Recorder(validation_draws)
    trainer = phalanx.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=3,
        num_sanity_val_steps=sanity_steps,
        default_root_dir=tmp_path / f"sanity{sanity_steps}",
    )
    trainer.fit(
        module,
        DataLoader(data, batch_size=4, shuffle=True),
        DataLoader(data, batch_size=4, shuffle=val_shuffle, num_workers=workers),
    )
    return module.seen, module.draws, torch.rand(()).item()


@pytest.mark.parametrize(
    ("validation_draws", "val_shuffle", "workers"),
    [("nothing", False, 0), ("torch", False, 0), ("python", False, 0), ("numpy", False, 0), ("torch", True, 0)]
    + [("nothing", False, 1)],
    ids=["plain", "torch draw", "python draw", "numpy draw", "shuffled validation", "a worker process"],
)
def test_a_fit_with_the_sanity_check_trains_as_one_without_it(tmp_path, validation_draws, val_shuffle, workers):
    with_check = _fit(tmp_path, 2, validation_draws, val_shuffle, workers)
    without = _fit(tmp_path, 0, validation_draws, val_shuffle, workers)
    assert with_check[0] == without[0], "the training batches came in another order"
    assert with_check[1] == without[1], "the training step drew other random numbers"
    assert with_check[2] == without[2], "the generators after the fit differ"


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_isolate_rng_puts_every_generator_back(raises):
    before = collect_rng_states()
    outside = pytest.raises(RuntimeError) if raises else contextlib.nullcontext()
    with outside, isolate_rng():
        torch.rand(5)
        random.random()
        np.random.rand(3)
        if raises:
            raise RuntimeError("inside")
    after = collect_rng_states()
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert before["numpy"] == after["numpy"]
