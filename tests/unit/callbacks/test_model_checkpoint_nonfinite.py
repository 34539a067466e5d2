"""A NaN/inf model never replaces a good checkpoint: non-finite scores rank worst, and a save point at which the
parameters are not all finite writes, replaces and removes nothing (unless ``save_on_nonfinite=True``)."""

import contextlib
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.callbacks._checkpoint_checks import local_parameters_finite
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


class NanAfter(phalanx.TrainingModule):
    """The loss (and so every parameter, after the optimizer step) becomes NaN from optimizer step ``k + 1`` on."""

    def __init__(self, k):
        super().__init__()
        self.k = k
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.global_step >= self.k:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)


def fit(tmp_path, callback, max_epochs=2, k=4):
    trainer = phalanx.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NanAfter(k))
    return trainer, [str(w.message) for w in caught if "not all finite" in str(w.message)]


def load(path):
    return torch.load(path, weights_only=True)


def all_finite(path):
    return all(torch.isfinite(t).all() for t in load(path)["state_dict"].values())


@pytest.mark.parametrize(
    ("options", "expected_best"),
    [
        ({"every_n_train_steps": 2, "save_top_k": 1}, "epoch=0-step=4.ckpt"),  # keep-newest: each save removes the last
        ({"every_n_train_steps": 1, "save_top_k": -1}, "epoch=0-step=4.ckpt"),  # keep all: no NaN file is added
        ({"every_n_train_steps": 1, "save_top_k": 2, "monitor": "train_loss"}, None),  # top-k eviction
        ({"every_n_epochs": 1, "save_top_k": 1}, "epoch=0-step=4.ckpt"),  # at epoch ends (4 steps per epoch)
    ],
)
def test_nan_parameters_never_replace_good_checkpoints(tmp_path, options, expected_best):
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, **options)
    trainer, messages = fit(tmp_path, callback)
    assert trainer.global_step == 8 and not all(torch.isfinite(p).all() for p in trainer.module.parameters())

    files = sorted(os.listdir(tmp_path / "ckpts"))
    assert files and all(all_finite(tmp_path / "ckpts" / name) for name in files)
    # Only checkpoints of the finite steps exist: the last save point before the NaN step was step 4.
    assert all(load(tmp_path / "ckpts" / name)["global_step"] <= 4 for name in files)
    assert load(callback.last_model_path)["global_step"] == 4
    if expected_best is not None:
        assert os.path.basename(callback.best_model_path) == expected_best
    assert callback.best_model_score is None or math.isfinite(callback.best_model_score.item())
    # Each skipped save point warned, naming the checkpoints it kept.
    assert messages
    assert all(callback.last_model_path in m and callback.best_model_path in m for m in messages)
    assert "save_on_nonfinite=True" in messages[0]


def test_save_on_nonfinite_saves_anyway(tmp_path):
    callback = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True, save_on_nonfinite=True
    )
    _, messages = fit(tmp_path, callback)
    assert messages == []
    last = load(callback.last_model_path)
    assert last["global_step"] == 8 and not all_finite(callback.last_model_path)


# ---------------------------------------------------------------------- the decision, with a fake trainer
class Strategy:
    def __init__(self, module, others_finite=True):
        self.module = module
        self.is_global_zero = True
        self.others_finite = others_finite
        self.decisions = []
        self.reads, self.reading = 0, False

    @contextlib.contextmanager
    def host_reads(self):
        self.reads, self.reading = self.reads + 1, True
        try:
            yield
        finally:
            self.reading = False

    def broadcast(self, obj, src=0):
        return obj

    def reduce_boolean_decision(self, decision, all=True):
        # A collective inside host_reads would wait for replicas that cannot enter it (XLA holds a lock there).
        assert not self.reading, "reduce_boolean_decision called inside host_reads"
        self.decisions.append((decision, all))
        return decision and self.others_finite if all else decision or self.others_finite

    def remove_checkpoint(self, path):
        os.remove(path)


class Trainer(SimpleNamespace):
    def __init__(self, root, strategy):
        super().__init__(
            callback_metrics={},
            global_step=0,
            current_epoch=0,
            sanity_checking=False,
            fast_dev_run=False,
            state=SimpleNamespace(fn="fit"),
            validation_enabled=False,
            loggers=[],
            log_dir=None,
            default_root_dir=str(root),
            is_global_zero=True,
            strategy=strategy,
            ckpt_path=None,
        )

    def save_checkpoint(self, filepath, weights_only=False):
        torch.save({"global_step": self.global_step}, filepath)


def steps(trainer, callback, first, last):
    for step in range(first, last + 1):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, step - 1)


def test_every_process_takes_the_same_decision(tmp_path):
    """Finite here but not on another process: the reduced decision (all=True) wins, and nothing is saved."""
    strategy = Strategy(torch.nn.Linear(2, 2), others_finite=False)
    trainer = Trainer(tmp_path, strategy)
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    callback.setup(trainer, None, "fit")
    with pytest.warns(UserWarning, match="not all finite"):
        steps(trainer, callback, 1, 4)
    assert os.listdir(tmp_path) == []
    # Checked once per save point (steps 2 and 4), never in between, always combined with all=True; the local check
    # reads the parameters inside the strategy's host_reads context, the collective runs outside it.
    assert strategy.decisions == [(True, True), (True, True)]
    assert strategy.reads == 2


def test_no_check_without_a_save_point_or_with_save_on_nonfinite(tmp_path):
    strategy = Strategy(torch.nn.Linear(2, 2))
    trainer = Trainer(tmp_path, strategy)
    quiet = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=5)
    quiet.setup(trainer, None, "fit")
    steps(trainer, quiet, 1, 4)
    assert strategy.decisions == []
    anyway = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=1, save_on_nonfinite=True)
    anyway.setup(trainer, None, "fit")
    steps(trainer, anyway, 1, 2)
    assert strategy.decisions == [] and len(os.listdir(tmp_path / "b")) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_local_check_finds_any_non_finite_parameter(bad):
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    # Buffers are not parameters: an attention mask full of -inf is normal.
    module.register_buffer("mask", torch.full((2, 2), float("-inf")))
    module.register_buffer("count", torch.tensor(3))
    assert local_parameters_finite(module)
    with torch.no_grad():
        module[1].bias[0] = bad
    assert not local_parameters_finite(module)


def test_meta_and_integer_parameters_are_skipped():
    module = torch.nn.Linear(2, 2, device="meta")
    module.register_parameter("steps", torch.nn.Parameter(torch.tensor([1, 2]), requires_grad=False))
    assert local_parameters_finite(module)


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_never_rank_above_finite_ones(tmp_path, mode, bad):
    trainer = Trainer(tmp_path, Strategy(None))
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="loss", mode=mode, save_top_k=2, every_n_train_steps=1)
    callback.setup(trainer, None, "fit")
    worst = 1e30 if mode == "min" else -1e30  # the worst finite score still ranks above a non-finite one
    for step, value in enumerate([worst, bad, 0.5], start=1):
        trainer.global_step = step
        trainer.callback_metrics = {"loss": torch.tensor(value)}
        callback.on_train_batch_end(trainer, None, None, None, step)
    # The non-finite one was stored while the top 2 was not full, then evicted first; it never was the best.
    assert sorted(torch.load(tmp_path / name)["global_step"] for name in os.listdir(tmp_path)) == [1, 3]
    assert callback.best_model_score.item() == 0.5
    trainer.global_step, trainer.callback_metrics = 4, {"loss": torch.tensor(bad)}
    assert callback.check_monitor_top_k(trainer, torch.tensor(bad)) is False
