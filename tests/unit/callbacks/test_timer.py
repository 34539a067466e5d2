"""Timer and ``Trainer(max_time=...)``, which runs as a Timer: on a fake clock (one second per training step) they stop
after the same step as Lightning's Timer, resume a checkpoint with the time it had spent, check each step or each epoch,
and refuse bad arguments naming the valid ones."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import callback_project as project
import pytest
import torch
from phalanx_testing import quiet_trainer

import phalanx
from phalanx.callbacks import ModelCheckpoint, Timer


@pytest.fixture
def fake_clock():
    """phalanx's Timer reads the project's clock (restored after the test)."""
    import phalanx.callbacks.timer as timer_module

    real = timer_module.time
    project.use_fake_clock("phalanx")
    yield
    timer_module.time = real


@pytest.fixture
def lightning_clock():
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of these rows")
    import pytorch_lightning.callbacks.timer as timer_module

    real = timer_module.time
    yield
    timer_module.time = real


def _same_run(ours: dict, theirs: dict) -> None:
    assert ours["global_step"] == theirs["global_step"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    for name, value in theirs["weights"].items():
        assert torch.allclose(torch.tensor(ours["weights"][name]), torch.tensor(value)), name


@pytest.mark.parametrize(("case", "steps"), [("timer", 17), ("timer_epoch", 20)])
def test_it_stops_after_the_step_lightnings_timer_stops_after(tmp_path, fake_clock, lightning_clock, case, steps):
    theirs = project.run("lightning", case, tmp_path / "lightning")
    ours = project.run("phalanx", case, tmp_path / "phalanx")
    # 17 s at one step a second; checked at epoch ends (10 steps each), 13 s is passed after the second epoch.
    assert ours["global_step"] == steps
    _same_run(ours, theirs)
    assert ours["files"] == theirs["files"]


@pytest.mark.parametrize("case", ["timer", "timer_epoch"])
def test_a_resumed_run_counts_the_time_its_checkpoint_had_spent(tmp_path, fake_clock, lightning_clock, case):
    runs = {}
    for framework in ("phalanx", "lightning"):
        whole = project.run(framework, case, tmp_path / framework / "whole")
        checkpoint = tmp_path / framework / "whole" / "ckpt" / "step=6.ckpt"
        assert torch.load(checkpoint, weights_only=True)["callbacks"]["Timer"]["time_elapsed"]["train"] == 6.0
        resumed = project.run(framework, case, tmp_path / framework / "resumed", ckpt_path=str(checkpoint))
        runs[framework] = whole, resumed
    (whole, resumed), (their_whole, their_resumed) = runs["phalanx"], runs["lightning"]
    # The stop comes after the same step as without the interruption, in both frameworks ...
    assert resumed["global_step"] == whole["global_step"] == their_resumed["global_step"] == their_whole["global_step"]
    # ... and phalanx's resumed run trains exactly the steps the whole run trained after step 6.
    _same_run(resumed, {**whole, "losses": whole["losses"][6:]})


@pytest.mark.parametrize("framework", ["lightning", "phalanx"])
def test_a_resumed_run_whose_time_is_spent_trains_nothing(
    tmp_path, fake_clock, lightning_clock, monkeypatch, framework
):
    """As Lightning, such a fit skips the training stage: no batch, and no on_train_start or epoch hooks either."""
    project.run(framework, "timer", tmp_path / "whole")
    state = torch.load(tmp_path / "whole" / "ckpt" / "step=16.ckpt", weights_only=True)
    state["callbacks"]["Timer"]["time_elapsed"]["train"] = 30.0  # more than the 17 s the Timer allows
    torch.save(state, tmp_path / "spent.ckpt")
    recorder, case_callbacks = project.Recorder(), project.case_callbacks
    hooks = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end")
    counting = project.framework_parts(framework)[2].LambdaCallback(**{name: recorder.hook(name) for name in hooks})
    monkeypatch.setattr(project, "case_callbacks", lambda *args: [*case_callbacks(*args), counting])
    resumed = project.run(framework, "timer", tmp_path / "resumed", ckpt_path=str(tmp_path / "spent.ckpt"))
    assert resumed["global_step"] == 16 and resumed["losses"] == []
    assert recorder.counts == {"on_fit_start": 1}


def test_max_time_is_a_timer_that_survives_a_resume(tmp_path, fake_clock):
    def fit(ckpt_path=None):
        saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = quiet_trainer(max_time={"seconds": 5}, max_epochs=3, callbacks=[saving], enable_checkpointing=True)
        project.STEPS[0] = 0
        model = project.module_class("phalanx")()
        trainer.fit(model, torch.utils.data.DataLoader(project.data(), batch_size=project.BATCH), ckpt_path=ckpt_path)
        return trainer

    trainer = fit()
    (timer,) = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    assert timer.duration == 5.0 and timer.time_elapsed() == 5.0
    assert trainer.global_step == 5
    # Resumed after 2 of its 5 seconds, it trains 3 more steps, not 5 (the time limit is the training's, not the fit's).
    assert fit(tmp_path / "step=2.ckpt").global_step == 5


def test_a_timer_among_the_callbacks_wins_over_max_time(caplog):
    timer = Timer(duration="00:01:00:00")
    with caplog.at_level(logging.INFO):
        trainer = quiet_trainer(max_time={"seconds": 5}, callbacks=[timer])
    assert [cb for cb in trainer.callbacks if isinstance(cb, Timer)] == [timer]
    assert "Ignoring Trainer(max_time=...)" in caplog.text


def test_the_defaults_on_with_a_timer(tmp_path, fake_clock, caplog):
    """Sanity check, progress bar, CSV logger and checkpointing on: the stop still comes after step 3."""
    model = project.module_class("phalanx")()
    project.STEPS[0] = 0
    trainer = phalanx.Trainer(
        accelerator="cpu", max_epochs=3, default_root_dir=tmp_path, callbacks=[Timer({"seconds": 3})]
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(
            model,
            torch.utils.data.DataLoader(project.data(), batch_size=4),
            torch.utils.data.DataLoader(project.data(8), batch_size=4),
        )
    assert trainer.global_step == 3
    assert "Time limit reached. Elapsed time is 0:00:03." in caplog.text
    (saved,) = (Path(trainer.checkpoint_callback.dirpath)).glob("*.ckpt")
    assert torch.load(saved, weights_only=True)["callbacks"]["Timer"]["time_elapsed"]["train"] == 3.0


def test_the_stages_are_timed(fake_clock):
    timer = Timer()
    project.STEPS[0] = 0
    trainer = quiet_trainer(max_epochs=1, callbacks=[timer])
    trainer.fit(project.module_class("phalanx")(), torch.utils.data.DataLoader(project.data(), batch_size=4))
    assert timer.time_elapsed("train") == 10.0 and timer.time_remaining() is None
    assert timer.start_time("train") == 0.0 and timer.end_time("train") == 10.0
    assert timer.time_elapsed("test") == 0.0 and timer.start_time("test") is None
    assert Timer(duration=timedelta(seconds=30)).time_remaining() == 30.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"duration": "1 hour"}, ValueError, r"Timer: duration='1 hour' is not valid; pass a 'DD:HH:MM:SS' string"),
        ({"duration": {"hour": 1}}, ValueError, r"unknown key\(s\) \['hour'\]; valid keys: \['weeks'"),
        ({"duration": 12}, TypeError, r"duration=12 \(of type int\) is not valid"),
        ({"duration": "00:00:00:00"}, ValueError, "must be a positive duration"),
        ({"interval": "batch"}, ValueError, r"Timer\(interval='batch'\) is not valid; choose 'step' or 'epoch'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_valid_ones(kwargs, error, match):
    with pytest.raises(error, match=match):
        Timer(**kwargs)


def test_an_unknown_stage_is_refused():
    with pytest.raises(ValueError, match=r"stage='training' is not a stage a Timer measures; choose one of \['train'"):
        Timer().time_elapsed("training")
