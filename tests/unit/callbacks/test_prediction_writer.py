"""BasePredictionWriter: per batch, per epoch or both, a writer gets what Lightning's gets (the same predictions, the
same dataset indices per batch, even from a shuffling loader), and data without indices is said to have none."""

from __future__ import annotations

from pathlib import Path

import callback_project as project
import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import BasePredictionWriter


def _written(folder: Path) -> dict[str, dict]:
    return {path.name: torch.load(path, weights_only=True) for path in sorted(folder.glob("*.pt"))}


def _same(ours, theirs) -> None:
    if isinstance(theirs, torch.Tensor):
        assert torch.allclose(ours, theirs)
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs)
        for mine, their in zip(ours, theirs):
            _same(mine, their)
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            _same(ours[key], theirs[key])
    else:
        assert ours == theirs


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_the_writer_gets_what_lightnings_gets(tmp_path, interval):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    case = f"writer_{interval}"
    theirs = project.run("lightning", case, tmp_path / "lightning")
    ours = project.run("phalanx", case, tmp_path / "phalanx")
    assert ours["files"] == theirs["files"]
    mine, their = _written(tmp_path / "phalanx" / "predictions"), _written(tmp_path / "lightning" / "predictions")
    _same(mine, their)
    if interval != "batch":
        assert mine["epoch_0.pt"]["indices"] == [[list(range(start, min(start + 4, 18))) for start in range(0, 18, 4)]]


class Recorded(BasePredictionWriter):
    def __init__(self, interval="batch_and_epoch"):
        super().__init__(interval)
        self.batches, self.epochs = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((dataloader_idx, batch_idx, list(batch_indices), batch[0].clone()))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


def test_a_shuffling_loader_gets_the_indices_it_drew():
    data = regression_data(20)
    writer = Recorded()
    trainer = quiet_trainer(callbacks=[writer])
    loader = DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(3))
    trainer.predict(Regressor(), loader, return_predictions=False)
    for _, _, indices, inputs in writer.batches:
        assert torch.equal(inputs, data.tensors[0][indices])  # each batch holds the samples its indices name
    assert sorted(i for _, _, indices, _ in writer.batches for i in indices) == list(range(20))
    ((predictions, indices),) = writer.epochs
    assert [len(p) for p in predictions] == [6, 6, 6, 2] and indices == [[b[2] for b in writer.batches]]


def test_with_the_defaults_two_dataloaders_and_returned_predictions(tmp_path):
    writer = Recorded()
    trainer = phalanx.Trainer(accelerator="cpu", default_root_dir=tmp_path, callbacks=[writer])
    loaders = [DataLoader(regression_data(8), batch_size=4), DataLoader(regression_data(6), batch_size=4)]
    returned = trainer.predict(Regressor(), loaders)
    assert [(d, b, i) for d, b, i, _ in writer.batches] == [
        (0, 0, [0, 1, 2, 3]), (0, 1, [4, 5, 6, 7]), (1, 0, [0, 1, 2, 3]), (1, 1, [4, 5]),
    ]  # fmt: skip
    ((predictions, indices),) = writer.epochs
    assert indices == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5]]]
    _same(predictions, returned)
    assert trainer._run.predict_outputs == []  # let go once the writers had them


class Batches:
    """An iterable of batches that is not a DataLoader."""

    def __iter__(self):
        return iter([(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(2)])

    def __len__(self):
        return 2


def test_data_without_indices_is_said_to_have_none():
    writer = Recorded()
    trainer = quiet_trainer(callbacks=[writer])
    with pytest.warns(UserWarning, match="Couldn't infer the batch indices fetched from your dataloader: Batches"):
        trainer.predict(Regressor(), Batches())
    assert [indices for _, _, indices, _ in writer.batches] == [[], []]
    assert writer.epochs[0][1] == [[]]


def test_a_bad_interval_is_refused_and_unwritten_methods_say_which():
    with pytest.raises(ValueError, match=r"write_interval='step' is not valid; choose one of \['batch', 'epoch'"):
        BasePredictionWriter("step")
    trainer = quiet_trainer(callbacks=[BasePredictionWriter("epoch")])
    with pytest.raises(NotImplementedError, match="override write_on_epoch_end"):
        trainer.predict(Regressor(), DataLoader(regression_data(4), batch_size=2))
