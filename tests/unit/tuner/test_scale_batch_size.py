"""Tuner.scale_batch_size and BatchSizeFinder: Lightning 2.6's batch size for a table of searches (out-of-memory
errors raised by the model at a size limit, since a CPU has none), the bounds that decide on a CPU, the size set on the
model or datamodule and used by the fit that follows, no trace left, and the refusals."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from phalanx_testing import parameters_of, same_parameters
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import BatchSizeFinder
from phalanx.tuner import Tuner


def _data(n: int = 100) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _module_class(base: type, limit: int) -> type:
    class Sized(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2
            self.net = nn.Linear(4, 1)
            self.sizes: list[int] = []

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_data(), batch_size=self.batch_size)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.sizes.append(len(batch[0]))
            if len(batch[0]) > limit:  # what a GPU raises when the batch does not fit
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Sized


QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
# (mode, out-of-memory above, max_trials, init_val, max_val)
SEARCHES = [
    ("power", 1000, 25, 2, 8192, "tuner"),  # no out-of-memory: the dataset's length bounds it
    ("power", 20, 25, 2, 8192, "callback"),
    ("power", 1000, 3, 2, 8192, "tuner"),  # max_trials bounds it
    ("power", 1000, 25, 3, 40, "callback"),  # max_val bounds it
    ("power", 1, 25, 4, 8192, "tuner"),  # every size fails: halved down to 1
    ("binsearch", 20, 25, 2, 8192, "callback"),
    ("binsearch", 37, 4, 2, 8192, "tuner"),
    ("binsearch", 50, 25, 5, 8192, "tuner"),
]


@pytest.mark.parametrize("search", SEARCHES, ids=str)
def test_a_search_finds_lightnings_batch_size(tmp_path, search):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    from pytorch_lightning.callbacks import BatchSizeFinder as LightningFinder
    from pytorch_lightning.tuner import Tuner as LightningTuner

    mode, limit, max_trials, init_val, max_val, via = search
    args = dict(mode=mode, max_trials=max_trials, init_val=init_val, max_val=max_val)
    found = {}
    for name, base, trainer_class, tuner, finder_class in (
        ("theirs", pl.LightningModule, pl.Trainer, LightningTuner, LightningFinder),
        ("ours", phalanx.TrainingModule, phalanx.Trainer, Tuner, BatchSizeFinder),
    ):
        model = _module_class(base, limit)()
        if via == "tuner":
            trainer = trainer_class(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path / name, **QUIET)
            found[name] = (tuner(trainer).scale_batch_size(model, **args), model.batch_size)
        else:
            finder = finder_class(**args)
            trainer = trainer_class(
                accelerator="cpu", max_steps=1, callbacks=[finder], default_root_dir=tmp_path / name, **QUIET
            )
            trainer.fit(model)  # its one step runs at the size found
            found[name] = (finder.optimal_batch_size, model.batch_size, model.sizes[-1])
    assert found["ours"] == found["theirs"]


class _Data(phalanx.DataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(64), batch_size=self.batch_size)


def test_the_search_leaves_no_trace_with_the_trainers_defaults_and_sets_the_datamodule(tmp_path):
    phalanx.seed_everything(0)
    model = _module_class(phalanx.TrainingModule, 16)()
    del model.batch_size  # the datamodule holds it
    before = parameters_of(model)
    data = _Data()
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path)
    assert Tuner(trainer).scale_batch_size(model, datamodule=data, mode="power") == 16
    assert data.batch_size == 16
    assert same_parameters(parameters_of(model), before)
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert os.listdir(tmp_path) == []
    trainer.fit(model, datamodule=data)
    assert set(model.sizes[-4:]) == {16}


def test_the_callback_under_the_trainers_defaults_trains_at_the_size_found(tmp_path):
    model = _module_class(phalanx.TrainingModule, 20)()
    finder = BatchSizeFinder(mode="binsearch", margin=0.0)
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[finder])
    trainer.fit(model)
    assert finder.optimal_batch_size == model.batch_size == 20
    assert trainer.global_step == 5 and model.sizes[-5:] == [20] * 5  # the search's steps are not counted


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "linear"}, ValueError, "mode='linear' is not supported; choose one of"),
        ({"max_trials": 0}, ValueError, "max_trials must be a positive integer"),
        ({"margin": 1.0}, ValueError, "margin must be in"),
        ({"method": "test"}, ValueError, "tunes for fit only"),
        ({"batch_arg_name": "bs"}, AttributeError, "needs a 'bs' attribute"),
        ({"train_dataloaders": DataLoader(_data(), batch_size=2)}, ValueError, "dataloaders given to fit directly"),
    ],
)
def test_a_search_that_cannot_run_is_refused(kwargs, error, match):
    model = _module_class(phalanx.TrainingModule, 1000)()
    with pytest.raises(error, match=match):
        Tuner(phalanx.Trainer(accelerator="cpu", **QUIET)).scale_batch_size(model, **kwargs)


def test_an_error_other_than_out_of_memory_is_raised():
    model = _module_class(phalanx.TrainingModule, 8)()
    model.training_step = lambda batch, batch_idx: (_ for _ in ()).throw(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        Tuner(phalanx.Trainer(accelerator="cpu", **QUIET)).scale_batch_size(model)


def test_the_fit_rebuilds_a_training_dataloader_that_configure_optimizers_built_early(tmp_path):
    class Scheduled(_module_class(phalanx.TrainingModule, 20)):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            steps = int(self.trainer.estimated_stepping_batches)  # builds the training dataloader before on_fit_start
            return {
                "optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=steps),
            }

    model = Scheduled()
    finder = BatchSizeFinder(mode="binsearch", margin=0.0)
    phalanx.Trainer(accelerator="cpu", max_epochs=1, callbacks=[finder], default_root_dir=tmp_path, **QUIET).fit(model)
    assert finder.optimal_batch_size == 20 and model.sizes[-5:] == [20] * 5
