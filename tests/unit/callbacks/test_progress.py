from types import SimpleNamespace

import pytest
import torch

from phalanx.callbacks import Callback, ProgressBar, TQDMProgressBar
from phalanx.callbacks import progress as progress_module


def make_trainer(**kwargs):
    defaults = dict(
        progress_bar_metrics={},
        loggers=[],
        is_global_zero=True,
        sanity_checking=False,
        current_epoch=0,
        num_training_batches=10,
        num_val_batches=[3, 2],
        num_sanity_val_batches=[2],
        num_test_batches=[4],
        num_predict_batches=[5],
        fit_loop=SimpleNamespace(batches_done=0),
        state=SimpleNamespace(fn="fit"),
    )
    defaults.update(kwargs)
    return SimpleNamespace(**defaults)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module, "_clock", fake)
    return fake


def test_base_enable_disable_and_get_metrics():
    bar = ProgressBar()
    assert isinstance(bar, Callback)
    assert bar.is_enabled
    bar.disable()
    assert not bar.is_enabled and bar.is_disabled
    bar.enable()
    assert bar.is_enabled

    trainer = make_trainer(
        progress_bar_metrics={
            "loss": torch.tensor(0.25),
            "acc": torch.tensor(0.5, dtype=torch.float64),
            "n": torch.tensor(3),
        }
    )
    metrics = bar.get_metrics(trainer, None)
    assert metrics == {"loss": 0.25, "acc": 0.5, "n": 3}
    assert all(not isinstance(v, torch.Tensor) for v in metrics.values())
    assert isinstance(metrics["n"], int)


def test_get_metrics_includes_logger_version():
    trainer = make_trainer(loggers=[SimpleNamespace(version=7)], progress_bar_metrics={"loss": torch.tensor(1.5)})
    assert ProgressBar().get_metrics(trainer, None) == {"v_num": 7, "loss": 1.5}


def test_non_zero_rank_is_disabled():
    bar = TQDMProgressBar()
    bar.setup(make_trainer(is_global_zero=False), None, "fit")
    assert bar.is_disabled


def test_refresh_rate_zero_disables_and_validation():
    assert TQDMProgressBar(refresh_rate=0).is_disabled
    with pytest.raises(ValueError, match="refresh_rate"):
        TQDMProgressBar(refresh_rate=-1)


def test_postfix_is_refreshed_at_most_every_tenth_of_a_second(clock, monkeypatch):
    bar = TQDMProgressBar()
    trainer = make_trainer(num_training_batches=100, progress_bar_metrics={"loss": torch.tensor(1.0)})
    reads = []
    original = bar.get_metrics

    def counting_get_metrics(*args):
        reads.append(clock.now)
        return original(*args)

    monkeypatch.setattr(bar, "get_metrics", counting_get_metrics)
    bar.setup(trainer, None, "fit")
    bar.on_train_start(trainer, None)
    bar.on_train_epoch_start(trainer, None)
    for batch_idx in range(50):
        clock.now += 0.01  # 10 ms batches: 0.5 s in all
        bar.on_train_batch_end(trainer, None, None, None, batch_idx)
        assert bar.train_progress_bar.n == batch_idx + 1
    # first batch, then every 0.1 s: about 5 reads for 50 batches, not 50
    assert 4 <= len(reads) <= 6
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(reads, reads[1:]))
    assert bar.train_progress_bar.postfix is not None and "loss=1" in bar.train_progress_bar.postfix
    bar.on_train_epoch_end(trainer, None)
    bar.on_train_end(trainer, None)
    assert bar.train_progress_bar is None


def test_last_batch_of_the_epoch_always_refreshes(clock, monkeypatch):
    bar = TQDMProgressBar()
    trainer = make_trainer(num_training_batches=3, progress_bar_metrics={"loss": torch.tensor(1.0)})
    bar.setup(trainer, None, "fit")
    bar.on_train_epoch_start(trainer, None)
    bar.on_train_batch_end(trainer, None, None, None, 0)
    trainer.progress_bar_metrics = {"loss": torch.tensor(0.125)}
    bar.on_train_batch_end(trainer, None, None, None, 1)  # same instant: not refreshed
    assert "0.125" not in bar.train_progress_bar.postfix
    bar.on_train_batch_end(trainer, None, None, None, 2)  # last batch: refreshed though no time passed
    assert "0.125" in bar.train_progress_bar.postfix


def test_train_bar_totals_resume_and_infinite(clock):
    bar = TQDMProgressBar()
    trainer = make_trainer(num_training_batches=20, fit_loop=SimpleNamespace(batches_done=7), current_epoch=2)
    bar.setup(trainer, None, "fit")
    bar.on_train_epoch_start(trainer, None)
    train_bar = bar.train_progress_bar
    assert train_bar.total == 20
    assert train_bar.n == 7 and train_bar.initial == 7
    assert "Epoch 2" in train_bar.desc
    bar.on_train_epoch_end(trainer, None)

    trainer = make_trainer(num_training_batches=float("inf"))
    bar = TQDMProgressBar()
    bar.setup(trainer, None, "fit")
    bar.on_train_epoch_start(trainer, None)
    assert bar.train_progress_bar.total is None
    bar.on_train_end(trainer, None)


def test_leave_creates_a_bar_per_epoch():
    trainer = make_trainer()
    keep = TQDMProgressBar(leave=True)
    keep.setup(trainer, None, "fit")
    keep.on_train_epoch_start(trainer, None)
    first = keep.train_progress_bar
    keep.on_train_epoch_end(trainer, None)
    keep.on_train_epoch_start(trainer, None)
    assert keep.train_progress_bar is not first
    keep.on_train_end(trainer, None)

    reuse = TQDMProgressBar(leave=False)
    reuse.setup(trainer, None, "fit")
    reuse.on_train_epoch_start(trainer, None)
    first = reuse.train_progress_bar
    reuse.on_train_epoch_end(trainer, None)
    reuse.on_train_epoch_start(trainer, None)
    assert reuse.train_progress_bar is first
    reuse.on_train_end(trainer, None)


def test_validation_sanity_test_and_predict_bars(capsys):
    bar = TQDMProgressBar()
    trainer = make_trainer(sanity_checking=True)
    bar.setup(trainer, None, "fit")
    bar.on_sanity_check_start(trainer, None)
    bar.on_validation_start(trainer, None)
    assert bar.val_progress_bar.total == 2
    assert "Sanity" in bar.val_progress_bar.desc
    bar.on_validation_end(trainer, None)
    bar.on_sanity_check_end(trainer, None)
    assert bar.val_progress_bar is None

    trainer.sanity_checking = False
    bar.on_validation_start(trainer, None)
    assert bar.val_progress_bar.total == 5
    for i in range(5):
        bar.on_validation_batch_end(trainer, None, None, None, i % 3, i // 3)
    assert bar.val_progress_bar.n == 5
    bar.on_validation_end(trainer, None)

    bar.on_test_start(trainer, None)
    assert bar.test_progress_bar.total == 4
    bar.on_test_batch_end(trainer, None, None, None, 0)
    assert bar.test_progress_bar.n == 1
    bar.on_test_end(trainer, None)
    bar.on_predict_start(trainer, None)
    assert bar.predict_progress_bar.total == 5
    bar.on_predict_end(trainer, None)
    captured = capsys.readouterr()
    assert captured.out == ""  # bars go to stderr
    assert "Validation" in captured.err


def test_refresh_rate_skips_updates(clock):
    bar = TQDMProgressBar(refresh_rate=4)
    trainer = make_trainer(num_training_batches=10)
    bar.setup(trainer, None, "fit")
    bar.on_train_epoch_start(trainer, None)
    for batch_idx in range(6):
        clock.now += 1
        bar.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert bar.train_progress_bar.n == 4
    bar.on_train_end(trainer, None)


def test_disabled_bar_survives_all_hooks():
    bar = TQDMProgressBar()
    bar.disable()
    trainer = make_trainer(progress_bar_metrics={"loss": torch.tensor(1.0)})
    bar.setup(trainer, None, "fit")
    bar.on_train_epoch_start(trainer, None)
    bar.on_train_batch_end(trainer, None, None, None, 0)
    bar.on_validation_start(trainer, None)
    bar.on_validation_batch_end(trainer, None, None, None, 0)
    bar.on_validation_end(trainer, None)
    bar.on_train_epoch_end(trainer, None)
    bar.on_train_end(trainer, None)
    assert bar.train_progress_bar is None


# ---------------------------------------------------------------------- with the real Trainer

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402


class Tiny(phalanx.TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n):
    return DataLoader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=4)


def test_tqdm_bar_runs_with_the_trainer(tmp_path, capsys):
    bar = TQDMProgressBar()
    trainer = phalanx.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[bar],
    )
    module = Tiny()
    trainer.fit(module, train_dataloaders=loader(16), val_dataloaders=loader(8))
    assert trainer.progress_bar_callback is bar
    err = capsys.readouterr().err
    assert "Sanity Checking" in err and "Epoch 1" in err and "4/4" in err
    assert "train_loss=" in err and "val_loss=" in err

    trainer.validate(module, dataloaders=loader(8))
    trainer.test(module, dataloaders=loader(12))
    predictions = trainer.predict(module, dataloaders=loader(8))
    err = capsys.readouterr().err
    assert "Validation" in err and "Testing" in err and "3/3" in err and "Predicting" in err
    assert len(predictions) == 2
    assert bar.train_progress_bar is None and bar.val_progress_bar is None
