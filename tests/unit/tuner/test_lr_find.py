"""Tuner.lr_find and LearningRateFinder: Lightning 2.6's swept rates, smoothed losses and suggestion for a table of
sweeps, the model's rate attribute updated, no trace left (weights, loggers' files, checkpoints, counters), the plot
and the refusals."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, parameters_of, quiet_trainer, regression_data, same_parameters
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import LearningRateFinder
from phalanx.tuner import Tuner


def _loader() -> DataLoader:
    return DataLoader(regression_data(64), batch_size=4)  # 16 batches an epoch


def _lightning_twin(pl: Any, model: Regressor) -> Any:
    class Twin(pl.LightningModule):
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = copy.deepcopy(model.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Twin(model.hparams.lr)


# (mode, min_lr, max_lr, num_training, early_stop_threshold, max_epochs, accumulate_grad_batches)
SWEEPS = [
    ("exponential", 1e-4, 10.0, 30, 4.0, 3, 1),  # diverges and stops early
    ("exponential", 1e-6, 1e-1, 20, None, 3, 1),  # runs every step
    ("linear", 1e-3, 0.3, 25, 4.0, 3, 1),
    ("linear", 1e-4, 0.5, 40, None, 1, 1),  # the epoch limit ends it first
    ("exponential", 1e-5, 1.0, 18, 4.0, 3, 2),  # one rate per accumulated step
]


@pytest.mark.parametrize("via", ["tuner", "callback"])
@pytest.mark.parametrize("sweep", SWEEPS, ids=str)
def test_a_sweep_finds_what_lightning_finds(tmp_path, sweep, via):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    from pytorch_lightning.callbacks import LearningRateFinder as LightningFinder
    from pytorch_lightning.tuner import Tuner as LightningTuner

    mode, min_lr, max_lr, num_training, threshold, max_epochs, accumulate = sweep
    phalanx.seed_everything(0)
    model = Regressor(hidden=8)
    twin = _lightning_twin(pl, model)
    options = dict(max_epochs=max_epochs, accumulate_grad_batches=accumulate)
    args = dict(min_lr=min_lr, max_lr=max_lr, mode=mode, early_stop_threshold=threshold)
    theirs_trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **options,
    )  # fmt: skip
    if via == "tuner":
        theirs = LightningTuner(theirs_trainer).lr_find(twin, _loader(), num_training=num_training, **args)
        ours = Tuner(quiet_trainer(**options)).lr_find(model, _loader(), num_training=num_training, **args)
    else:
        their_finder, our_finder = (
            cls(num_training_steps=num_training, **args) for cls in (LightningFinder, LearningRateFinder)
        )
        theirs_trainer.callbacks.insert(0, their_finder)
        theirs_trainer.fit(twin, _loader())
        quiet_trainer(callbacks=[our_finder], **options).fit(model, _loader())
        theirs, ours = their_finder.optimal_lr, our_finder.optimal_lr
    assert ours is not None and theirs is not None
    assert ours.results["lr"] == pytest.approx(theirs.results["lr"], rel=1e-12)
    assert ours.results["loss"] == pytest.approx(theirs.results["loss"], abs=1e-5, nan_ok=True)
    assert ours.suggestion() == pytest.approx(theirs.suggestion(), rel=1e-12)
    assert model.hparams.lr == pytest.approx(twin.hparams.lr, rel=1e-12)
    if via == "callback":  # the fit that followed trained at the suggestion, as Lightning's did
        assert torch.allclose(model.net[0].weight, twin.net[0].weight, atol=1e-5)


def test_the_finder_leaves_no_trace_with_the_trainers_defaults(tmp_path):
    phalanx.seed_everything(0)
    model = Regressor(hidden=8)
    before = parameters_of(model)
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=2, default_root_dir=tmp_path)
    result = Tuner(trainer).lr_find(model, _loader(), num_training=20, update_attr=False)
    assert result is not None and len(result.results["lr"]) == 20
    assert same_parameters(parameters_of(model), before)
    assert model.hparams.lr == 0.05
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert os.listdir(tmp_path) == []  # no logger's version folder, no checkpoint, no temporary file
    # A fit with the finder as a callback ends as a plain fit at the suggested rate: the sweep left nothing behind.
    runs = []
    for finder in (LearningRateFinder(num_training_steps=20), None):
        phalanx.seed_everything(0)
        twin = Regressor(hidden=8, lr=runs[0][1] if runs else 0.05)
        fit_trainer = phalanx.Trainer(
            accelerator="cpu", max_epochs=2, default_root_dir=tmp_path / str(len(runs)),
            callbacks=[finder] if finder else [],
        )  # fmt: skip
        fit_trainer.fit(twin, _loader(), DataLoader(regression_data(16), batch_size=4))
        files = sorted(str(p.relative_to(fit_trainer.default_root_dir)) for p in (tmp_path / str(len(runs))).rglob("*"))
        runs.append((parameters_of(twin), twin.hparams.lr, fit_trainer.global_step, files))
    assert runs[0][1] != 0.05 and runs[0][1] == runs[1][1]
    assert same_parameters(runs[0][0], runs[1][0])
    assert runs[0][2] == runs[1][2] == 32
    assert runs[0][3] == runs[1][3]


class _NamedRate(Regressor):
    def __init__(self) -> None:
        super().__init__(hidden=8)
        del self.hparams["lr"]
        self.step_size = 0.05
        self.learning_rate = 0.05

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.step_size)


@pytest.mark.parametrize(
    ("attr_name", "updated", "kept"), [("", "learning_rate", "step_size"), ("step_size", "step_size", "learning_rate")]
)
def test_the_rate_attribute_is_found_or_named(attr_name, updated, kept):
    phalanx.seed_everything(0)
    model = _NamedRate()
    result = Tuner(quiet_trainer(max_epochs=3)).lr_find(model, _loader(), num_training=30, attr_name=attr_name)
    assert result is not None and getattr(model, updated) == result.suggestion() != 0.05
    assert getattr(model, kept) == 0.05


def test_the_plot_is_saved_and_marks_the_suggestion(tmp_path):
    pytest.importorskip("matplotlib")
    phalanx.seed_everything(0)
    result = Tuner(quiet_trainer(max_epochs=3)).lr_find(Regressor(hidden=8), _loader(), num_training=30)
    assert result is not None
    figure = result.plot(suggest=True, path=tmp_path / "lr.png")
    assert (tmp_path / "lr.png").stat().st_size > 0
    axes = figure.axes[0]
    assert axes.get_xscale() == "log" and len(axes.lines) == 2  # the curve and the red point


def test_too_few_points_give_no_suggestion():
    phalanx.seed_everything(0)
    result = Tuner(quiet_trainer(max_epochs=1)).lr_find(Regressor(hidden=8), _loader(), num_training=5)
    assert result is not None and len(result.results["lr"]) == 5
    assert result.suggestion() is None


class _NoRate(Regressor):
    def __init__(self) -> None:
        super().__init__(hidden=8)
        del self.hparams["lr"]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _TwoOptimizers(Regressor):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "match"),
    [
        (Regressor, {"mode": "cosine"}, ValueError, "mode='cosine' is not supported; choose one of"),
        (Regressor, {"min_lr": 1.0, "max_lr": 0.1}, ValueError, "needs 0 < min_lr < max_lr"),
        (Regressor, {"num_training": 0}, ValueError, "num_training must be a positive"),
        (Regressor, {"method": "validate"}, ValueError, "tunes for fit only"),
        (Regressor, {"attr_name": "missing"}, AttributeError, "'missing' is neither an attribute"),
        (_NoRate, {}, AttributeError, "one of \\('lr', 'learning_rate'\\)"),
        (_TwoOptimizers, {}, ValueError, "returned 2 optimizers; the learning rate finder needs exactly one"),
    ],
)
def test_a_sweep_that_cannot_run_is_refused(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        Tuner(quiet_trainer(max_epochs=1)).lr_find(model(), _loader(), **kwargs)


def test_fast_dev_run_skips_the_finder():
    with pytest.warns(UserWarning, match="skipped with fast_dev_run"):
        assert Tuner(quiet_trainer(fast_dev_run=True)).lr_find(Regressor(), _loader()) is None


@pytest.mark.parametrize("via", ["tuner", "callback"])
def test_the_sweep_draws_nothing_the_fit_after_it_sees(tmp_path, via):
    """With a shuffled loader the sweep draws seeds and orders from the global generators; as Lightning's finder, it
    gives them back, so the fit after it shuffles as it would without the sweep."""
    shuffled = DataLoader(regression_data(64), batch_size=4, shuffle=True)
    if via == "tuner":
        phalanx.seed_everything(0)
        trainer, model = (
            phalanx.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path),
            Regressor(hidden=8),
        )
        before = torch.get_rng_state()
        Tuner(trainer).lr_find(model, shuffled, num_training=20)
        assert torch.equal(torch.get_rng_state(), before)
        return
    runs = []
    for finder in (LearningRateFinder(num_training_steps=20), None):
        phalanx.seed_everything(0)
        model = Regressor(hidden=8, lr=runs[0][1] if runs else 0.05)
        trainer = phalanx.Trainer(
            accelerator="cpu", max_epochs=1, default_root_dir=tmp_path / str(len(runs)),
            callbacks=[finder] if finder else [], enable_progress_bar=False,
        )  # fmt: skip
        trainer.fit(model, shuffled)
        runs.append((parameters_of(model), model.hparams.lr))
    assert runs[0][1] != 0.05
    assert same_parameters(runs[0][0], runs[1][0])
