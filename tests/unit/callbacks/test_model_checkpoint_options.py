"""ModelCheckpoint options of Lightning: save_on_exception, save_last="link", train_time_interval, and -vN names."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx.callbacks._checkpoint_saves as saves_module
import phalanx.callbacks.model_checkpoint as checkpoint_module
from phalanx.callbacks import ModelCheckpoint


class Failing(Regressor):
    """Raises ``error`` in training_step once ``fail_at`` optimizer steps were taken; logs a score that improves."""

    def __init__(
        self, fail_at: int | None = None, error: type[BaseException] = RuntimeError, where: str = "training_step"
    ) -> None:
        super().__init__()
        self.fail_at, self.error, self.where = fail_at, error, where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where == "training_step" and self.fail_at is not None and self.global_step >= self.fail_at:
            raise self.error("boom")
        self.log("score", torch.tensor(-float(self.global_step)))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.where == "validation_step":
            raise self.error("boom in validation")
        super().validation_step(batch, batch_idx)

    def on_train_start(self) -> None:
        if self.where == "on_train_start":
            raise self.error("boom before training")


def entries(folder) -> list[str]:
    return sorted(os.listdir(folder))


def step_of(path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def fit(callback: ModelCheckpoint, model: Any, val: bool = False, **options: Any) -> Any:
    train_loader, val_loader = loaders()
    trainer = quiet_trainer(callbacks=[callback], enable_checkpointing=True, **options)
    trainer.fit(model, train_loader, val_loader if val else None)
    return trainer


# ---------------------------------------------------------------------------- save_on_exception
EXCEPTION_CASES = [
    # (id, callback options, model options, trainer options, files expected after the failure, step in the new file)
    ("error after 3 steps", dict(), dict(fail_at=3), dict(max_epochs=2), ["epoch=0-step=3.ckpt"], 3),
    (
        "KeyboardInterrupt",
        dict(),
        dict(fail_at=5, error=KeyboardInterrupt),
        dict(max_epochs=2),
        ["epoch=0-step=5.ckpt"],
        5,
    ),
    (
        "taken name gets -v1",
        dict(filename="fixed", every_n_train_steps=2),
        dict(fail_at=3),
        dict(max_epochs=2),
        ["fixed-v1.ckpt", "fixed.ckpt"],
        3,
    ),
    (
        "last follows it",
        dict(save_last=True, every_n_train_steps=2),
        dict(fail_at=3),
        dict(max_epochs=2),
        ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"],
        3,
    ),
    (
        "already saved at this step",
        dict(every_n_train_steps=1, filename="{step}"),
        dict(fail_at=4),
        dict(max_epochs=2),
        ["step=4.ckpt"],
        None,
    ),
    ("off", dict(save_on_exception=False), dict(fail_at=3), dict(max_epochs=2), [], None),
    ("in the sanity check", dict(), dict(where="validation_step", fail_at=0), dict(max_epochs=2, val=True), [], None),
    ("before the first step", dict(), dict(where="on_train_start"), dict(max_epochs=2), [], None),
    ("fast_dev_run", dict(), dict(fail_at=1), dict(fast_dev_run=3), [], None),
]


@pytest.mark.parametrize(
    ("callback_options", "model_options", "trainer_options", "files", "step"),
    [c[1:] for c in EXCEPTION_CASES],
    ids=[c[0] for c in EXCEPTION_CASES],
)
def test_save_on_exception_keeps_the_state_of_a_failed_fit(
    tmp_path, callback_options, model_options, trainer_options, files, step
):
    callback = ModelCheckpoint(dirpath=tmp_path, **{"save_on_exception": True, **callback_options})
    model = Failing(**model_options)
    error = model_options.get("error", RuntimeError)
    val = trainer_options.pop("val", False)
    with pytest.raises(error, match="boom"):  # the original exception, unchanged
        fit(callback, model, val=val, **trainer_options)
    assert entries(tmp_path) == files
    if step is not None:
        new = [name for name in files if "v1" in name] or [f"epoch=0-step={step}.ckpt"]
        assert step_of(tmp_path / new[0]) == step
        saved = torch.load(tmp_path / new[0], weights_only=True)["state_dict"]
        assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())
    if "fixed.ckpt" in files:
        assert step_of(tmp_path / "fixed.ckpt") == 2  # the kept checkpoint was not replaced
    if "last.ckpt" in files:
        assert step_of(tmp_path / "last.ckpt") == step


def test_a_fit_resumed_from_the_exception_checkpoint_ends_as_an_uninterrupted_one(tmp_path):
    torch.manual_seed(0)
    uninterrupted = Failing()
    quiet_trainer(max_steps=6).fit(uninterrupted, loaders()[0])
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom"):
        fit(ModelCheckpoint(dirpath=tmp_path, save_on_exception=True), Failing(fail_at=3), max_steps=6)
    resumed = Failing()
    trainer = quiet_trainer(max_steps=6)
    trainer.fit(resumed, loaders()[0], ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    assert trainer.global_step == 6
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted.parameters(), resumed.parameters()))


def test_a_failing_exception_save_only_warns_and_the_original_error_is_raised(tmp_path, monkeypatch):
    callback = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_epochs=5)
    trainer = quiet_trainer(callbacks=[callback], enable_checkpointing=True, max_epochs=2)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(trainer, "save_checkpoint", disk_full)
    with (
        pytest.warns(UserWarning, match="could not save after RuntimeError: OSError: No space left"),
        pytest.raises(RuntimeError, match="^boom$"),
    ):
        trainer.fit(Failing(fail_at=2), loaders()[0])
    assert entries(tmp_path) == []  # and the claimed name was released


def test_save_on_exception_is_ignored_with_several_processes(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True)
    fake = SimpleNamespace(
        world_size=2,
        is_global_zero=True,
        strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj),
        loggers=[],
        default_root_dir=str(tmp_path),
    )
    with pytest.warns(UserWarning, match=r"save_on_exception=True\) is ignored with 2 processes"):
        callback.setup(fake, None, "fit")
    assert (
        callback._should_save_on_exception(
            SimpleNamespace(
                world_size=2,
                fast_dev_run=False,
                global_step=3,
                state=SimpleNamespace(fn="fit"),
                strategy=SimpleNamespace(module=object()),
            )
        )
        is False
    )


# ---------------------------------------------------------------------------- save_last="link"
LINK_CASES = [
    # (id, callback options, trainer options, expected entries, what last.ckpt is: a link target name or "file", its
    # step)
    (
        "newest of top-1",
        dict(every_n_train_steps=2),
        dict(max_steps=6),
        ["epoch=0-step=6.ckpt", "last.ckpt"],
        "epoch=0-step=6.ckpt",
        6,
    ),
    (
        "newest of top-2 by score",
        dict(monitor="score", mode="max", save_top_k=2, every_n_train_steps=2),
        dict(max_steps=4),
        ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"],
        "epoch=0-step=4.ckpt",
        4,
    ),
    # At step 6 the score is not among the best two: no checkpoint holds that state, so last.ckpt is written as a file.
    (
        "not among the top-2",
        dict(monitor="score", mode="max", save_top_k=2, every_n_train_steps=2),
        dict(max_steps=6),
        ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"],
        "file",
        6,
    ),
    (
        "keep all, every epoch",
        dict(save_top_k=-1),
        dict(max_epochs=3),
        ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"],
        "epoch=2-step=24.ckpt",
        24,
    ),
    (
        "final state not in a checkpoint",
        dict(every_n_train_steps=4),
        dict(max_steps=6),
        ["epoch=0-step=4.ckpt", "last.ckpt"],
        "file",
        6,
    ),
    (
        "save_top_k=0: nothing to link to",
        dict(save_top_k=0, every_n_train_steps=2),
        dict(max_steps=4),
        ["last.ckpt"],
        "file",
        4,
    ),
]


class Scored(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Better every step but worse from step 4 on: at step 6 the new checkpoint is not among the best two.
        self.log("score", torch.tensor(float(self.global_step if self.global_step < 5 else -self.global_step)))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("callback_options", "trainer_options", "files", "last", "step"),
    [c[1:] for c in LINK_CASES],
    ids=[c[0] for c in LINK_CASES],
)
def test_save_last_link_points_last_at_the_newest_checkpoint(
    tmp_path, callback_options, trainer_options, files, last, step
):
    callback = ModelCheckpoint(dirpath=tmp_path, save_last="link", **callback_options)
    model = Scored()
    fit(callback, model, **trainer_options)
    assert entries(tmp_path) == files  # no dangling link, no temporary or retired entry left
    link = tmp_path / "last.ckpt"
    if last == "file":
        assert not link.is_symlink()
    else:
        assert link.is_symlink() and os.readlink(link) == last  # relative, inside the folder
    assert step_of(link) == step
    saved = torch.load(link, weights_only=True)["state_dict"]
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())
    assert callback.last_model_path == str(link)


@pytest.mark.parametrize(
    "options", [dict(every_n_train_steps=2), dict(monitor="score", mode="max", save_top_k=1, every_n_train_steps=1)]
)
def test_last_link_leaves_a_checkpoint_before_it_is_removed(tmp_path, options):
    callback = ModelCheckpoint(dirpath=tmp_path, save_last="link", **options)
    trainer = quiet_trainer(callbacks=[callback], enable_checkpointing=True, max_steps=4)
    removals = []
    remove = trainer.strategy.remove_checkpoint

    def checked_remove(path: Any) -> None:
        removals.append((os.path.basename(path), os.readlink(tmp_path / "last.ckpt")))
        remove(path)

    trainer.strategy.remove_checkpoint = checked_remove
    trainer.fit(Scored(), loaders()[0])
    assert removals and all(removed != linked for removed, linked in removals)  # never removed while last.ckpt names it


def test_a_regular_last_file_from_an_earlier_run_is_replaced_by_the_link_on_resume(tmp_path):
    first = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    fit(first, Regressor(), max_steps=4)
    assert not (tmp_path / "last.ckpt").is_symlink() and step_of(tmp_path / "last.ckpt") == 4
    second = ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=2)
    trainer = quiet_trainer(callbacks=[second], enable_checkpointing=True, max_steps=8)
    trainer.fit(Regressor(), loaders()[0], ckpt_path="last")
    assert entries(tmp_path) == ["epoch=0-step=8.ckpt", "last.ckpt"]  # the regular last.ckpt became the link, in place
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=0-step=8.ckpt" and step_of(tmp_path / "last.ckpt") == 8


def test_a_foreign_last_file_is_never_replaced(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"someone else's")
    fit(ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=2), Regressor(), max_steps=2)
    assert (tmp_path / "last.ckpt").read_bytes() == b"someone else's"
    assert os.readlink(tmp_path / "last-v1.ckpt") == "epoch=0-step=2.ckpt"


def test_ckpt_path_last_follows_the_link_and_only_to_a_complete_checkpoint(tmp_path):
    fit(ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=3), Regressor(), max_steps=6)
    resumed = ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=3)
    trainer = quiet_trainer(callbacks=[resumed], enable_checkpointing=True, max_steps=9)
    assert trainer._checkpoint_connector.resolve_path("last") == str(tmp_path / "epoch=0-step=6.ckpt")
    trainer.fit(Regressor(), loaders()[0], ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "epoch=0-step=6.ckpt") and trainer.global_step == 9
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=9.ckpt"
    (tmp_path / "epoch=1-step=9.ckpt").unlink()  # the link now dangles: it names no checkpoint
    with pytest.raises(ValueError, match="ckpt_path='last': no complete last checkpoint"):
        quiet_trainer(
            callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True
        )._checkpoint_connector.resolve_path("last")


def test_where_links_cannot_be_made_last_is_a_regular_copy(tmp_path, monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("symbolic links are not supported here")

    monkeypatch.setattr(os, "symlink", refuse)
    with pytest.warns(UserWarning, match="cannot make symbolic links; writing .*last.ckpt as a regular checkpoint"):
        fit(ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=2), Regressor(), max_steps=4)
    assert entries(tmp_path) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert not (tmp_path / "last.ckpt").is_symlink() and step_of(tmp_path / "last.ckpt") == 4


def test_a_last_name_that_changes_removes_the_old_link_only(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, save_last="link", save_top_k=-1)
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"
    fit(callback, Regressor(), max_epochs=2)
    assert entries(tmp_path) == ["epoch=0-step=8.ckpt", "epoch=1-last.ckpt", "epoch=1-step=16.ckpt"]
    assert os.readlink(tmp_path / "epoch=1-last.ckpt") == "epoch=1-step=16.ckpt"


def test_save_last_link_needs_a_local_folder():
    with pytest.raises(
        ValueError,
        match=r"save_last='link'\) makes a symbolic link, which needs a local folder; dirpath='memory://ckpts'",
    ):
        fit(ModelCheckpoint(dirpath="memory://ckpts", save_last="link"), Regressor(), max_steps=1)


# ---------------------------------------------------------------------------- train_time_interval
class Clock:
    """A monotonic clock that the training step advances by one second per batch."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Ticking(Regressor):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += 1.0
        return super().training_step(batch, batch_idx)


TIME_CASES = [
    # (interval in seconds, max_steps, steps saved)
    (2.5, 7, [3, 6]),
    (1.0, 3, [1, 2, 3]),
    (0.0, 2, [1, 2]),
    (10.0, 7, []),
]


@pytest.mark.parametrize(("seconds", "steps", "saved"), TIME_CASES)
def test_train_time_interval_saves_when_the_time_has_passed(tmp_path, monkeypatch, seconds, steps, saved):
    clock = Clock()
    for module in (checkpoint_module, saves_module):
        monkeypatch.setattr(module, "time", clock)
    callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, train_time_interval=timedelta(seconds=seconds))
    fit(callback, Ticking(clock), max_steps=steps)
    assert entries(tmp_path) == [f"epoch=0-step={step}.ckpt" for step in saved]  # and not at the epoch's end


def test_train_time_decision_is_rank_zeros(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(hours=1))
    callback._last_time_checked = float("inf")  # this rank's clock says: not yet
    decided = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda obj, src=0: True))  # rank 0 says: now
    assert callback._time_to_save(decided) is True
    assert "train_time_interval': datetime.timedelta(seconds=3600)" in callback.state_key
    assert callback.every_n_epochs == 0 and callback.train_time_interval == timedelta(hours=1)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"train_time_interval": 60}, TypeError, "must be a datetime.timedelta"),
        ({"train_time_interval": timedelta(seconds=-1)}, ValueError, "must not be negative"),
        (
            {"train_time_interval": timedelta(minutes=1), "every_n_train_steps": 5},
            ValueError,
            "every_n_train_steps=5` are mutually exclusive",
        ),
        (
            {"train_time_interval": timedelta(minutes=1), "every_n_epochs": 1},
            ValueError,
            "every_n_epochs=1` are mutually exclusive",
        ),
        ({"save_on_exception": "yes"}, TypeError, "save_on_exception"),
        ({"save_last": "links"}, TypeError, "save_last` must be True, False, None or 'link'"),
    ],
)
def test_bad_new_options_are_refused_at_construction(options, error, match):
    with pytest.raises(error, match=match):
        ModelCheckpoint(**options)


# ---------------------------------------------------------------------------- -vN when a name repeats
VERSION_CASES = [
    # (id, callback options, steps, files)
    (
        "keep all, same name",
        dict(filename="{epoch}", save_top_k=-1, monitor="score", mode="max"),
        3,
        ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0.ckpt"],
    ),
    (
        "best two, same name",
        dict(filename="{epoch}", save_top_k=2, monitor="score", mode="max"),
        3,
        ["epoch=0-v1.ckpt", "epoch=0.ckpt"],
    ),
    ("newest only: the name is reused", dict(filename="{epoch}"), 3, ["epoch=0.ckpt"]),
    (
        "version counter off: overwritten",
        dict(filename="{epoch}", save_top_k=-1, monitor="score", mode="max", enable_version_counter=False),
        3,
        ["epoch=0.ckpt"],
    ),
    (
        "a file of another run is kept",
        dict(filename="{epoch}", save_top_k=-1, monitor="score", mode="max"),
        1,
        ["epoch=0-v1.ckpt", "epoch=0.ckpt"],
    ),
]


@pytest.mark.parametrize(
    ("options", "steps", "files"), [c[1:] for c in VERSION_CASES], ids=[c[0] for c in VERSION_CASES]
)
def test_a_repeated_name_gets_a_version_suffix(tmp_path, options, steps, files):
    if steps == 1:
        (tmp_path / "epoch=0.ckpt").write_bytes(b"another run's")
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, **options)
    fit(callback, Scored(), max_steps=steps)
    assert entries(tmp_path) == files
    if steps == 1:
        assert (tmp_path / "epoch=0.ckpt").read_bytes() == b"another run's"
    assert set(callback.best_k_models) <= {str(tmp_path / name) for name in files}
    if callback.save_top_k == -1 and callback.enable_version_counter:
        assert sorted(step_of(tmp_path / name) for name in files if step_of_safe(tmp_path / name)) == list(
            range(1, steps + 1)
        )


def step_of_safe(path) -> bool:
    return path.read_bytes()[:2] == b"PK"  # a torch zip archive, not another run's bytes
