"""DataModule.from_datasets, as Lightning users build a DataModule from datasets they already have."""

from __future__ import annotations

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import IterableDataset, TensorDataset

from phalanx import DataModule


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.full((2,), float(i)) for i in range(5))


def test_from_datasets_builds_one_loader_per_stage_with_the_given_options():
    train, val = regression_data(24), regression_data(12, seed=1)
    datamodule = DataModule.from_datasets(train_dataset=train, val_dataset=val, batch_size=5, num_workers=0)
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    assert train_loader.dataset is train and val_loader.dataset is val
    assert train_loader.batch_size == 5 and val_loader.batch_size == 5
    assert isinstance(train_loader.sampler, torch.utils.data.RandomSampler)  # training data is shuffled
    assert isinstance(val_loader.sampler, torch.utils.data.SequentialSampler)  # evaluation keeps the order
    assert not hasattr(datamodule, "test_dataloader") and not hasattr(datamodule, "predict_dataloader")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (lambda a, b: [a, b], lambda loaders: [len(loader.dataset) for loader in loaders] == [8, 4]),
        (lambda a, b: (a, b), lambda loaders: [len(loader.dataset) for loader in loaders] == [8, 4]),
        (
            lambda a, b: {"x": a, "y": b},
            lambda loaders: {k: len(v.dataset) for k, v in loaders.items()} == {"x": 8, "y": 4},
        ),
    ],
    ids=["list", "tuple", "dict"],
)
def test_several_datasets_give_several_loaders(given, expected):
    datamodule = DataModule.from_datasets(val_dataset=given(regression_data(8), regression_data(4)))
    assert expected(datamodule.val_dataloader())


def test_an_iterable_dataset_is_not_shuffled():
    loader = DataModule.from_datasets(train_dataset=Stream(), batch_size=2).train_dataloader()
    assert [batch[:, 0].tolist() for batch in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 must be a positive int"),
        ({"batch_size": 2.0}, "batch_size=2.0 must be a positive int"),
        ({"batch_size": True}, "batch_size=True must be a positive int"),
        ({"num_workers": -1}, "num_workers=-1 must be an int >= 0"),
    ],
)
def test_bad_loader_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataModule.from_datasets(train_dataset=regression_data(4), **kwargs)


def test_something_that_is_not_a_dataset_is_refused_when_the_loader_is_built():
    datamodule = DataModule.from_datasets(train_dataset=42)
    with pytest.raises(TypeError, match="train_dataset must hold torch Datasets .* got int"):
        datamodule.train_dataloader()


def test_a_subclass_receives_its_own_arguments_and_trains():
    class Sized(DataModule):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag

    datamodule = Sized.from_datasets(
        train_dataset=regression_data(16), val_dataset=regression_data(8), batch_size=4, tag="t"
    )
    assert isinstance(datamodule, Sized) and datamodule.tag == "t"
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(Regressor(), datamodule=datamodule)
    assert trainer.global_step == 4
    assert isinstance(datamodule.val_dataloader().dataset, TensorDataset)
