"""Public pieces Lightning users reach for: TrainerState's finished/stopped, refusing sync_batchnorm=True beside a
custom LayerSync, and awareness of interactive sessions (notebooks) when choosing and launching a strategy."""

from __future__ import annotations

import sys

import pytest
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch import nn

import phalanx
from phalanx.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from phalanx.strategies import DDPStrategy
from phalanx.trainer.state import RunningStage, TrainerFn, TrainerState, TrainerStatus


# ---------------------------------------------------------------------------- TrainerState
@pytest.mark.parametrize(
    ("status", "finished", "stopped"),
    [
        (TrainerStatus.INITIALIZING, False, False),
        (TrainerStatus.RUNNING, False, False),
        (TrainerStatus.FINISHED, True, True),
        (TrainerStatus.INTERRUPTED, False, True),
        (TrainerStatus.FAILED, False, True),
    ],
)
def test_trainer_state_says_whether_the_run_finished_or_stopped(status, finished, stopped):
    state = TrainerState(fn=TrainerFn.FITTING, status=status)
    assert (state.finished, state.stopped, status.stopped) == (finished, stopped, stopped)


@pytest.mark.parametrize(
    ("stage", "evaluating", "prefix"),
    [
        (RunningStage.TRAINING, False, "train"),
        (RunningStage.SANITY_CHECKING, False, "val"),
        (RunningStage.VALIDATING, True, "val"),
        (RunningStage.TESTING, True, "test"),
        (RunningStage.PREDICTING, False, "predict"),
    ],
)
def test_running_stage_names_its_dataloader_prefix(stage, evaluating, prefix):
    assert (stage.evaluating, stage.dataloader_prefix) == (evaluating, prefix)


def test_a_finished_fit_leaves_the_state_finished(tmp_path):
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1)
    assert not trainer.state.finished and not trainer.state.stopped
    trainer.fit(Regressor(), loaders(16)[0])
    assert trainer.state.finished and trainer.state.stopped
    assert trainer.state.fn == TrainerFn.FITTING and trainer.state.stage is None


# ---------------------------------------------------------------------------- sync_batchnorm with a LayerSync plugin
class MyLayerSync(LayerSync):
    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        return model


@pytest.mark.parametrize("strategy", ["ddp_spawn", "auto"])
@pytest.mark.parametrize(
    ("sync_batchnorm", "plugin", "refused"),
    [
        (True, MyLayerSync(), True),
        (False, MyLayerSync(), False),
        (True, TorchSyncBatchNorm(), False),
    ],
)
def test_sync_batchnorm_is_refused_beside_a_custom_layer_sync(strategy, sync_batchnorm, plugin, refused):
    arguments = dict(accelerator="cpu", strategy=strategy, devices=2, sync_batchnorm=sync_batchnorm, plugins=[plugin])
    if refused:
        with pytest.raises(ValueError, match="sync_batchnorm=True and the MyLayerSync plugin both"):
            phalanx.Trainer(**arguments)
    else:
        assert phalanx.Trainer(**arguments).strategy.layer_sync is plugin


# ---------------------------------------------------------------------------- interactive sessions
@pytest.fixture
def interactive(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)


@pytest.mark.parametrize(
    ("strategy", "start_method"),
    [("auto", "fork"), ("ddp_notebook", "fork"), ("ddp_fork", "fork")],
)
def test_in_an_interactive_session_auto_picks_fork(interactive, strategy, start_method):
    trainer = phalanx.Trainer(accelerator="cpu", strategy=strategy, devices=2, logger=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.launcher.is_interactive_compatible
    assert trainer.strategy._start_method == start_method


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_find_unused_parameters_true"])
def test_in_an_interactive_session_strategies_that_cannot_start_processes_are_refused(interactive, strategy):
    with pytest.raises(ValueError, match=f"strategy='{strategy}' cannot start its processes from an interactive"):
        phalanx.Trainer(accelerator="cpu", strategy=strategy, devices=2, logger=False)


def test_in_an_interactive_session_a_strategy_instance_that_spawns_is_refused(interactive):
    with pytest.raises(ValueError, match="Use strategy='ddp_notebook'"):
        phalanx.Trainer(accelerator="cpu", strategy=DDPStrategy(start_method="spawn"), devices=2, logger=False)


@pytest.mark.parametrize("strategy", ["auto", "ddp", "ddp_spawn"])
def test_outside_an_interactive_session_nothing_changes(strategy):
    assert not hasattr(sys, "ps1")
    trainer = phalanx.Trainer(accelerator="cpu", strategy=strategy, devices=2, logger=False)
    assert trainer.strategy._start_method == ("spawn" if strategy == "ddp_spawn" else "popen")


def test_in_an_interactive_session_one_device_needs_no_launcher(interactive):
    assert phalanx.Trainer(accelerator="cpu", devices=1, logger=False).strategy.launcher is None
