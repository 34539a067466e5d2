"""Trainer(profiler=...): the argument, the report of each stage with the hooks' and the strategy's rows,
``trainer.profiler.profile`` from module and callback code (with no profiler too), and a run that leaves nothing
installed behind, whether it ends or fails."""

from __future__ import annotations

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import Callback
from phalanx.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler
from phalanx.trainer.profiling import STRATEGY_ACTIONS


class Profiled(Regressor):
    """Times its own actions through ``self.trainer.profiler``, as Lightning modules do."""

    def training_step(self, batch, batch_idx):
        with self.trainer.profiler.profile("module_action"):
            return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class ProfilingCallback(Callback):
    def on_train_epoch_end(self, trainer, module):
        with trainer.profiler.profile("callback_action"):
            pass


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, PassThroughProfiler),
        ("simple", SimpleProfiler),
        ("Advanced", AdvancedProfiler),
        ("PYTORCH", PyTorchProfiler),
    ],
)
def test_the_profiler_argument_takes_lightnings_names(value, kind):
    assert type(quiet_trainer(profiler=value).profiler) is kind


def test_a_profiler_object_is_used_as_given():
    profiler = SimpleProfiler(filename="perf")
    assert quiet_trainer(profiler=profiler).profiler is profiler


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("xla", ValueError, r"profiler='xla' is not supported: .*torch_xla.debug.profiler"),
        ("fast", ValueError, r"profiler='fast' is not valid; pass one of \['advanced', 'pytorch', 'simple'\]"),
        (3, TypeError, "profiler=3 .*of type int.* is not valid"),
        (SimpleProfiler, TypeError, "profiler=SimpleProfiler is a class, not an instance"),
    ],
)
def test_a_bad_profiler_argument_is_refused_at_construction(value, error, message):
    with pytest.raises(error, match=message):
        quiet_trainer(profiler=value)


def test_barebones_refuses_a_profiler():
    with pytest.raises(ValueError, match=r"barebones=True, profiler='simple'.*turns off profiling"):
        phalanx.Trainer(barebones=True, profiler="simple")


@pytest.mark.parametrize("profiler", [None, "simple", "advanced"])
def test_module_and_callback_code_can_profile_whatever_the_profiler(profiler):
    # Before phalanx had profilers, self.trainer.profiler raised AttributeError in the first training_step.
    trainer = quiet_trainer(max_epochs=1, profiler=profiler, callbacks=[ProfilingCallback()])
    trainer.fit(Profiled(), loaders()[0])
    assert trainer.global_step == 8


# The rows a fit with the Trainer's defaults (logger, checkpointing, progress bar, sanity check) reports, with the
# number of calls each has in 2 epochs of 8 batches, validating 4 batches after each (2 more in the sanity check).
FIT_ROWS = {
    "run_training_epoch": 2,
    "run_training_batch": 16,
    "[FitLoop].train_dataloader_next": 16,  # a sized epoch ends at its last batch, without one more fetch
    "[Strategy]SingleDeviceStrategy.training_step": 16,
    "[Strategy]SingleDeviceStrategy.backward": 16,
    "[Strategy]SingleDeviceStrategy.optimizer_step": 16,
    "[Strategy]SingleDeviceStrategy.validation_step": 10,
    "[Strategy]SingleDeviceStrategy.save_checkpoint": 2,
    "save_checkpoint": 2,
    "[TrainingModule]Profiled.on_train_batch_end": 16,
    "[Callback]TQDMProgressBar.on_train_batch_end": 16,
    "module_action": 16,
    "callback_action": 2,
}


def test_a_fit_with_the_defaults_reports_the_hooks_and_the_strategys_steps(tmp_path):
    trainer = phalanx.Trainer(
        accelerator="cpu",
        max_epochs=2,
        default_root_dir=tmp_path,
        profiler=SimpleProfiler(filename="perf"),
        callbacks=[ProfilingCallback()],
    )
    train, val = loaders()
    trainer.fit(Profiled(), train, torch.utils.data.DataLoader(val.dataset, batch_size=16))
    report = (tmp_path / "logs" / "version_0" / "fit-perf.txt").read_text()
    calls = {line.split("|")[1].strip(): int(line.split("|")[3]) for line in report.splitlines()[4:] if "|" in line}
    assert {name: calls.get(name) for name in FIT_ROWS} == FIT_ROWS
    checkpoint_rows = [name for name in calls if name.startswith("[Callback]ModelCheckpoint")]
    assert any(name.endswith(".on_train_epoch_end") for name in checkpoint_rows), sorted(calls)


@pytest.mark.parametrize(
    ("stage", "row"),
    [
        ("validate", "[Strategy]SingleDeviceStrategy.validation_step"),
        ("test", "[Strategy]SingleDeviceStrategy.test_step"),
        ("predict", "[Strategy]SingleDeviceStrategy.predict_step"),
    ],
)
def test_each_evaluation_stage_writes_its_own_report(tmp_path, stage, row):
    trainer = quiet_trainer(default_root_dir=tmp_path, profiler=SimpleProfiler(filename="perf"))
    loader = loaders()[1]
    getattr(trainer, stage)(Regressor(), loader)
    report = (tmp_path / f"{stage}-perf.txt").read_text()
    assert report.startswith(f"{stage.upper()} Profiler Report")
    assert f"| {row} " in report


def test_the_advanced_profiler_reports_the_functions_of_each_step(tmp_path):
    trainer = quiet_trainer(max_steps=3, default_root_dir=tmp_path, profiler=AdvancedProfiler(filename="perf"))
    trainer.fit(Regressor(), loaders()[0])
    report = (tmp_path / "fit-perf.txt").read_text()
    section = report.split("Profile stats for: [Strategy]SingleDeviceStrategy.training_step")[1]
    assert "(training_step)" in section.split("Profile stats for:")[0]


def _installed(trainer: phalanx.Trainer) -> dict[str, list[str]]:
    """The attributes that shadow a method on the Trainer, its strategy and its fit loop."""
    return {
        "trainer": [name for name in vars(trainer) if name == "save_checkpoint"],
        "strategy": [name for name in STRATEGY_ACTIONS if name in vars(trainer.strategy)],
        "fit_loop": [
            name for name in vars(trainer.fit_loop) if name.startswith("_") and callable(vars(trainer.fit_loop)[name])
        ],
    }


NOTHING = {"trainer": [], "strategy": [], "fit_loop": []}


@pytest.mark.parametrize("profiler", [None, "simple", "pytorch"])
def test_a_run_leaves_nothing_installed(tmp_path, profiler):
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, profiler=profiler)
    seen: list[dict[str, list[str]]] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen.append(_installed(trainer))

    trainer.callbacks.append(Spy())
    model = Regressor()
    trainer.fit(model, loaders()[0])
    trainer.validate(model, loaders()[1], verbose=False)
    assert _installed(trainer) == NOTHING
    # While it runs, a recording profiler shadows the strategy's steps; without one nothing is touched.
    assert (seen[0] != NOTHING) == (profiler is not None)


class Failing(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_failed_run_removes_what_it_installed_and_closes_the_report(tmp_path):
    profiler = SimpleProfiler(filename="perf")
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, profiler=profiler)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), loaders()[0])
    assert _installed(trainer) == NOTHING
    assert profiler._output is None
    trainer.fit(Regressor(), loaders()[0])  # the same Trainer and profiler profile the next run
    assert "run_training_batch" in (tmp_path / "fit-perf.txt").read_text()


class Recording(Profiler):
    """A user's own profiler: only start and stop."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def start(self, action_name: str) -> None:
        self.events.append(("start", action_name))

    def stop(self, action_name: str) -> None:
        self.events.append(("stop", action_name))


def test_a_users_profiler_sees_the_optimizer_step_enclose_forward_and_backward():
    profiler = Recording()
    quiet_trainer(max_steps=1, profiler=profiler).fit(Regressor(), loaders()[0])
    strategy = "[Strategy]SingleDeviceStrategy"
    parts = {f"{strategy}.{name}" for name in ("optimizer_step", "training_step", "backward")}
    step = [event for event in profiler.events if event[1] in parts]
    assert step == [
        ("start", f"{strategy}.optimizer_step"),
        ("start", f"{strategy}.training_step"),
        ("stop", f"{strategy}.training_step"),
        ("start", f"{strategy}.backward"),
        ("stop", f"{strategy}.backward"),
        ("stop", f"{strategy}.optimizer_step"),
    ]
