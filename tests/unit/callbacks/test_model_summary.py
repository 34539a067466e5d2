from types import SimpleNamespace

import pytest
import torch
from torch import nn

from phalanx.callbacks import ModelSummary
from phalanx.callbacks.model_summary import human_readable_count, parameter_counts, summarize


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))  # 220 + 105
        self.head = nn.Linear(5, 2)  # 12
        self.norm = nn.BatchNorm1d(2)  # 4 params (+ buffers, not counted)
        for p in self.norm.parameters():
            p.requires_grad_(False)


def test_counts_for_a_known_model():
    assert parameter_counts(Net()) == (337, 4, 341)


def test_table_depth_one():
    text = summarize(Net(), max_depth=1)
    lines = text.splitlines()
    assert "Name" in lines[0] and "Type" in lines[0] and "Params" in lines[0]
    rows = [line for line in lines if line[:1].isdigit() and "|" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["encoder", "head", "norm"]
    assert [row.split("|")[2].strip() for row in rows] == ["Sequential", "Linear", "BatchNorm1d"]
    assert [row.split("|")[3].strip() for row in rows] == ["325", "12", "4"]
    assert any(line.startswith("337") and "Trainable params" in line for line in lines)
    assert any(line.startswith("4 ") and "Non-trainable params" in line for line in lines)
    assert any(line.startswith("341") and "Total params" in line for line in lines)
    assert any(line.startswith("0.001") and "(MB)" in line for line in lines)  # 341 * 4 bytes


def test_table_all_depths_and_none():
    deep = summarize(Net(), max_depth=-1)
    assert "encoder.0" in deep and "encoder.2" in deep
    shallow = summarize(Net(), max_depth=0)
    assert "encoder" not in shallow and "Total params" in shallow


def test_shared_parameters_counted_once():
    model = nn.Module()
    model.a = nn.Linear(3, 3)
    model.b = model.a
    assert parameter_counts(model)[2] == 12


def test_lazy_and_meta_parameters_do_not_crash():
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    text = summarize(lazy, max_depth=1)
    assert parameter_counts(lazy) == (10, 0, 10)
    assert "lazy" in text.lower()

    with torch.device("meta"):
        meta = nn.Linear(1000, 1000)
    assert parameter_counts(meta)[2] == 1_001_000
    assert "1.0 M" in summarize(meta)


def test_human_readable_count():
    assert human_readable_count(0) == "0"
    assert human_readable_count(999) == "999"
    assert human_readable_count(1234) == "1.2 K"
    assert human_readable_count(2_500_000) == "2.5 M"
    assert human_readable_count(3_000_000_000) == "3.0 B"


def test_callback_prints_on_rank_zero_only(capsys):
    callback = ModelSummary(max_depth=1)
    callback.on_fit_start(SimpleNamespace(is_global_zero=False), Net())
    assert capsys.readouterr().out == ""
    callback.on_fit_start(SimpleNamespace(is_global_zero=True), Net())
    out = capsys.readouterr().out
    assert "encoder" in out and "Total params" in out
    ModelSummary(max_depth=0).on_fit_start(SimpleNamespace(is_global_zero=True), Net())
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-2)


def test_summary_printed_by_the_trainer(tmp_path, capsys):
    from torch.utils.data import DataLoader, TensorDataset

    import phalanx

    class Tiny(phalanx.TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = phalanx.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), train_dataloaders=DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2))
    out = capsys.readouterr().out
    assert "layer" in out and "Linear" in out
    assert any(line.startswith("5 ") and "Total params" in line for line in out.splitlines())
