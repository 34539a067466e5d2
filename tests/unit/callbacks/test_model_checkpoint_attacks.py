"""A resumed checkpoint's ModelCheckpoint state can never make the callback remove or overwrite anything but its own
checkpoints: every path it names is checked against ``dirpath`` (resolved like the kernel does) and against what a
checkpoint looks like (a regular ``*.ckpt`` file, or a ``*.ckpt`` directory with its ``.complete`` marker)."""

import os
import shutil
import uuid
import warnings
from types import SimpleNamespace

import fsspec
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


@pytest.fixture(autouse=True)
def _no_removal_outside_tmp_path(tmp_path, monkeypatch):
    """Safety net: should the protection regress, fail the test rather than delete outside ``tmp_path``.

    (These tests name '/' and the test's root as checkpoints; run as root, an unguarded rmtree would be a disaster.)
    """
    root = os.path.realpath(tmp_path) + os.sep

    def guard(function):
        def guarded(path, *args, **kwargs):
            # Calls relative to a directory descriptor come from inside a guarded rmtree.
            if kwargs.get("dir_fd") is None and not isinstance(path, int):
                parent = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))
                if not (parent + os.sep).startswith(root):
                    raise AssertionError(f"attempted to remove {path!r}, outside the test's folder")
            return function(path, *args, **kwargs)

        return guarded

    for module, name in ((os, "unlink"), (os, "remove"), (os, "rmdir"), (shutil, "rmtree")):
        monkeypatch.setattr(module, name, guard(getattr(module, name)))


class DecreasingValLoss(phalanx.TrainingModule):
    """Every epoch is a new best (val_loss = 1 / (epoch + 1)), so every save point evicts and replaces a file."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(1.0 / (self.current_epoch + 1)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=4)


def fit(root, dirpath, monitor, max_epochs, ckpt_path=None):
    callback = ModelCheckpoint(dirpath=dirpath, monitor=monitor, save_top_k=1, save_last=True, filename="{epoch}")
    trainer = phalanx.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[callback],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DecreasingValLoss(), ckpt_path=ckpt_path)
    return callback, [str(w.message) for w in caught]


# ---------------------------------------------------------------------- the sentinels an attack aims at
def build_sentinels(tmp_path):
    """A checkpoint folder ``run/ckpts`` among files, folders and links that must survive any resume."""
    dirpath = tmp_path / "run" / "ckpts"
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.txt").write_text("secret")
    (outside / "victim.ckpt").write_bytes(b"someone else's checkpoint")
    (outside / "dir.ckpt").mkdir()
    (outside / "dir.ckpt" / ".complete").write_bytes(b"")
    (outside / "dir.ckpt" / "shard.bin").write_bytes(b"shard")
    (outside / "plain").mkdir()
    (outside / "plain" / "data.txt").write_text("data")
    (tmp_path / "run" / "victim.ckpt").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "victim.ckpt").write_bytes(b"beside the folder")
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "notes.txt").write_text("notes")
    (dirpath / "nomarker.ckpt").mkdir()
    (dirpath / "nomarker.ckpt" / "payload").write_text("payload")
    (dirpath / "sub").mkdir()
    (dirpath / "sub" / "deep.ckpt").write_bytes(b"deeper")
    os.symlink(outside / "secret.txt", dirpath / "link.ckpt")
    os.symlink(outside / "dir.ckpt", dirpath / "dirlink.ckpt")
    os.symlink(outside / "deep", dirpath / "hop")
    os.symlink(tmp_path / "run", tmp_path / "alias")
    return dirpath, outside


def snapshot(tmp_path):
    """Every entry under ``tmp_path`` except the callback's own checkpoints: kind and content."""
    state = {}
    for folder, dirs, files in os.walk(tmp_path):
        for name in dirs + files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, tmp_path)
            if os.path.islink(path):
                state[relative] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                state[relative] = ("dir",)
            elif os.path.dirname(relative) != os.path.join("run", "ckpts") or not _written_by_callback(name):
                with open(path, "rb") as handle:
                    state[relative] = ("file", handle.read())
    return state


def _written_by_callback(name):
    return name.endswith(".ckpt") and (name.startswith("last") or name.startswith("epoch="))


# name -> hostile path, built from (tmp_path, dirpath, outside)
HOSTILE = {
    "absolute checkpoint elsewhere": lambda t, d, o: str(o / "victim.ckpt"),
    "absolute non-checkpoint elsewhere": lambda t, d, o: str(o / "secret.txt"),
    "marked checkpoint directory elsewhere": lambda t, d, o: str(o / "dir.ckpt"),
    "plain directory elsewhere": lambda t, d, o: str(o / "plain"),
    "dot-dot escape": lambda t, d, o: f"{d}/../../outside/victim.ckpt",
    "dot-dot escape to a directory": lambda t, d, o: f"{d}/../../outside/dir.ckpt",
    "dot-dot beside the folder": lambda t, d, o: f"{d}/../victim.ckpt",
    "relative path elsewhere": lambda t, d, o: os.path.relpath(o / "victim.ckpt"),
    "dot-dot through a linked folder": lambda t, d, o: f"{d}/hop/../victim.ckpt",
    "dot-dot through a linked ancestor": lambda t, d, o: f"{t}/alias/ckpts/../victim.ckpt",
    "link inside to a file outside": lambda t, d, o: str(d / "link.ckpt"),
    "link inside to a directory outside": lambda t, d, o: str(d / "dirlink.ckpt"),
    "the folder itself": lambda t, d, o: str(d),
    "the folder with a slash": lambda t, d, o: f"{d}/",
    "the folder's parent": lambda t, d, o: str(d.parent),
    "the folder as dot": lambda t, d, o: f"{d}/.",
    "the root": lambda t, d, o: "/",
    "the test's root": lambda t, d, o: str(t),
    "non-checkpoint inside": lambda t, d, o: str(d / "notes.txt"),
    "directory without marker inside": lambda t, d, o: str(d / "nomarker.ckpt"),
    "checkpoint in a subfolder": lambda t, d, o: str(d / "sub" / "deep.ckpt"),
    "url elsewhere": lambda t, d, o: "memory://attack-target/victim.ckpt",
}
# Entries that pass the path check (a *.ckpt name directly inside dirpath) and are refused when removal is attempted.
REFUSED_AT_REMOVAL = {
    "link inside to a file outside",
    "link inside to a directory outside",
    "directory without marker inside",
}


@pytest.fixture
def memory_victim():
    fs = fsspec.filesystem("memory")
    fs.pipe("/attack-target/victim.ckpt", b"remote checkpoint")
    yield fs
    fs.rm("/attack-target", recursive=True)


def tamper(source, target, state_key, hostile, score=100.0):
    """The attack: rewrite the callback state of a real checkpoint (read the safe way) to name ``hostile``."""
    checkpoint = torch.load(source, weights_only=True)
    state = checkpoint["callbacks"][state_key]
    state["best_k_models"] = {hostile: torch.tensor(score)}
    state["kth_best_model_path"] = hostile
    state["kth_value"] = torch.tensor(score)
    state["best_model_path"] = hostile
    state["last_model_path"] = hostile
    torch.save(checkpoint, target)


@pytest.mark.parametrize("monitor", ["val_loss", None])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_resume_from_tampered_checkpoint_removes_nothing_outside(tmp_path, case, monitor, memory_victim):
    dirpath, outside = build_sentinels(tmp_path)
    first, _ = fit(tmp_path, dirpath, monitor, max_epochs=1)
    hostile = HOSTILE[case](tmp_path, dirpath, outside)
    tampered = tmp_path / "run" / "tampered.ckpt"
    tamper(first.last_model_path, tampered, first.state_key, hostile)
    before = snapshot(tmp_path)

    second, messages = fit(tmp_path, dirpath, monitor, max_epochs=3, ckpt_path=str(tampered))

    # Resumed and trained on, evicting its own checkpoints (epoch 1 made way for epoch 2); nothing else changed.
    assert second.best_model_path == str(dirpath / "epoch=2.ckpt") and os.path.isfile(second.best_model_path)
    assert not os.path.exists(dirpath / "epoch=1.ckpt")
    assert snapshot(tmp_path) == before
    assert memory_victim.cat("/attack-target/victim.ckpt") == b"remote checkpoint"
    # A warning names the refused path (dropped at restore, or left in place at removal).
    assert any(repr(hostile) in m for m in messages), messages
    if case not in REFUSED_AT_REMOVAL:
        assert hostile not in second.best_k_models and second.last_model_path != hostile


# ---------------------------------------------------------------------- the same through load_state_dict directly
class RemovingStrategy:
    """Removes through the real TorchCheckpointIO (files with unlink, directories with rmtree)."""

    is_global_zero = True
    module = None

    def broadcast(self, obj, src=0):
        return obj

    def reduce_boolean_decision(self, decision, all=True):
        return decision

    def remove_checkpoint(self, path):
        TorchCheckpointIO().remove_checkpoint(path)


class FakeTrainer(SimpleNamespace):
    def __init__(self, root):
        super().__init__(
            callback_metrics={},
            global_step=0,
            current_epoch=0,
            sanity_checking=False,
            fast_dev_run=False,
            state=SimpleNamespace(fn="fit"),
            validation_enabled=True,
            check_val_every_n_epoch=1,
            val_check_interval=0.5,  # several validations an epoch: saves come from on_validation_end
            loggers=[],
            log_dir=None,
            default_root_dir=str(root),
            is_global_zero=True,
            strategy=RemovingStrategy(),
            ckpt_path=None,
        )

    def save_checkpoint(self, filepath, weights_only=False):
        TorchCheckpointIO().save_checkpoint({"global_step": self.global_step}, filepath)


def run_epochs(trainer, callback, epochs):
    for epoch in epochs:
        trainer.current_epoch, trainer.global_step = epoch, (epoch + 1) * 10
        trainer.callback_metrics = {"val_loss": torch.tensor(1.0 / (epoch + 1))}
        callback.on_validation_end(trainer, None)


# Each field alone, with the monitor setting under which the callback removes what it names.
@pytest.mark.parametrize(
    ("field", "monitor"),
    [
        ("best_k_models", "val_loss"),
        ("kth_best_model_path", "val_loss"),
        ("best_model_path", "val_loss"),
        ("best_model_path", None),
        ("last_model_path", None),
    ],
)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_load_state_dict_with_hostile_paths(tmp_path, case, field, monitor, memory_victim):
    dirpath, outside = build_sentinels(tmp_path)
    hostile = HOSTILE[case](tmp_path, dirpath, outside)
    callback = ModelCheckpoint(dirpath=dirpath, monitor=monitor, save_top_k=1, save_last=True, filename="{epoch}")
    trainer = FakeTrainer(tmp_path)
    state = callback.state_dict()
    state["dirpath"] = str(dirpath)
    if field == "best_k_models":
        state[field] = {hostile: torch.tensor(100.0)}
    else:
        state[field] = hostile
    before = snapshot(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.setup(trainer, None, "fit")
        callback.load_state_dict(state)
        run_epochs(trainer, callback, range(2))
    assert snapshot(tmp_path) == before
    assert memory_victim.cat("/attack-target/victim.ckpt") == b"remote checkpoint"
    assert os.listdir(dirpath / "nomarker.ckpt") == ["payload"]
    if case not in REFUSED_AT_REMOVAL:
        assert any(repr(hostile) in str(w.message) for w in caught)
        assert hostile not in callback.best_k_models
        assert hostile not in (callback.kth_best_model_path, callback.best_model_path, callback.last_model_path)


@pytest.mark.parametrize(
    ("case", "hostile"),
    [
        ("dot-dot escape", "memory://{run}/ckpts/../outside/victim.ckpt"),
        ("sibling folder", "memory://{run}/outside/victim.ckpt"),
        ("the folder itself", "memory://{run}/ckpts"),
        ("the folder's parent", "memory://{run}"),
        ("subfolder", "memory://{run}/ckpts/sub/deep.ckpt"),
        ("non-checkpoint inside", "memory://{run}/ckpts/notes.txt"),
        ("directory without marker inside", "memory://{run}/ckpts/nomarker.ckpt"),
        ("other protocol", "file://{tmp}/victim.ckpt"),
        ("local path", "{tmp}/victim.ckpt"),
    ],
)
def test_fsspec_folder_resists_hostile_paths(tmp_path, case, hostile):
    run = f"attack-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    sentinels = {
        f"/{run}/outside/victim.ckpt": b"victim",
        f"/{run}/ckpts/sub/deep.ckpt": b"deep",
        f"/{run}/ckpts/notes.txt": b"notes",
        f"/{run}/ckpts/nomarker.ckpt/payload": b"payload",
        f"/{run}/keep.txt": b"keep",
    }
    for path, data in sentinels.items():
        fs.pipe(path, data)
    (tmp_path / "victim.ckpt").write_bytes(b"local victim")
    hostile = hostile.format(run=run, tmp=tmp_path)
    try:
        dirpath = f"memory://{run}/ckpts"
        first, _ = fit(tmp_path, dirpath, "val_loss", max_epochs=1)
        tampered = tmp_path / "tampered.ckpt"
        with fsspec.open(first.last_model_path, "rb") as handle:
            (tmp_path / "original.ckpt").write_bytes(handle.read())
        tamper(tmp_path / "original.ckpt", tampered, first.state_key, hostile)
        second, messages = fit(tmp_path, dirpath, "val_loss", max_epochs=3, ckpt_path=str(tampered))
        assert {path: fs.cat(path) for path in sentinels} == sentinels
        assert (tmp_path / "victim.ckpt").read_bytes() == b"local victim"
        assert second.best_model_path == f"{dirpath}/epoch=2.ckpt" and fs.exists(f"/{run}/ckpts/epoch=2.ckpt")
        assert not fs.exists(f"/{run}/ckpts/epoch=1.ckpt")
        assert any(repr(hostile) in m for m in messages), messages
    finally:
        fs.rm(f"/{run}", recursive=True)


# ---------------------------------------------------------------------- what may still be removed
@pytest.mark.parametrize("kind", ["file", "marked directory", "file named through a linked ancestor"])
def test_restored_checkpoints_inside_the_folder_are_still_removed(tmp_path, kind):
    """The control: real checkpoints the state names inside dirpath are evicted as before."""
    dirpath, _ = build_sentinels(tmp_path)
    old = dirpath / "old.ckpt"
    if kind == "marked directory":
        old.mkdir()
        (old / ".complete").write_bytes(b"")
        (old / "shard.bin").write_bytes(b"x")
    else:
        old.write_bytes(b"old checkpoint")
    named = str(tmp_path / "alias" / "ckpts" / "old.ckpt") if "linked" in kind else str(old)
    callback = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1, filename="{epoch}")
    trainer = FakeTrainer(tmp_path)
    callback.setup(trainer, None, "fit")
    state = callback.state_dict()
    state.update(best_k_models={named: torch.tensor(100.0)}, kth_best_model_path=named, best_model_path=named)
    callback.load_state_dict(state)
    assert callback.best_k_models == {str(old): torch.tensor(100.0)}
    before = snapshot(tmp_path)
    run_epochs(trainer, callback, [0])
    assert not os.path.lexists(old)
    assert callback.best_model_path == str(dirpath / "epoch=0.ckpt")
    after = snapshot(tmp_path)
    assert {k: v for k, v in before.items() if "old.ckpt" not in k} == after


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: {"best_k_models": [f"{d}/a.ckpt"]}, "best_k_models"),
        (lambda d: {"best_k_models": {f"{d}/a.ckpt": "0.5"}}, "best_k_models"),
        (lambda d: {"best_k_models": {f"{d}/a.ckpt": torch.tensor([1.0, 2.0])}}, "best_k_models"),
        (lambda d: {"best_model_score": "best"}, "best_model_score"),
        (lambda d: {"best_model_score": True}, "best_model_score"),
        (lambda d: {"kth_value": torch.zeros(3)}, "kth_value"),
        (lambda d: {"current_score": [0.5]}, "current_score"),
    ],
)
def test_malformed_state_is_a_checkpoint_error(tmp_path, change, match):
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    full = {**callback.state_dict(), **change(callback.dirpath)}
    with pytest.raises(CheckpointError, match=match):
        callback.load_state_dict(full)


def test_state_that_is_not_a_dict_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a dict"):
        ModelCheckpoint(dirpath=tmp_path).load_state_dict(["best_model_path"])


def test_non_string_paths_are_dropped(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True)
    state = callback.state_dict()
    state.update(best_k_models={42: torch.tensor(1.0)}, last_model_path=b"last.ckpt", best_model_path=3.5)
    with pytest.warns(UserWarning, match="42"):
        callback.load_state_dict(state)
    assert callback.best_k_models == {} and callback.last_model_path == "" and callback.best_model_path == ""


# ---------------------------------------------------------------------- last.ckpt replaced by a folder of the user's
def _foreign_directory(path):
    path.mkdir()
    (path / "payload").write_text("the user's data")


def _marker_is_a_link(path):
    _foreign_directory(path)
    os.symlink(path.parent.parent / "elsewhere", path / ".complete")


def _marker_is_a_directory(path):
    _foreign_directory(path)
    (path / ".complete").mkdir()


FOREIGN_LAST = {
    "directory without marker": _foreign_directory,
    "directory whose marker is a link": _marker_is_a_link,
    "directory whose marker is a directory": _marker_is_a_directory,
}
# save_last, save_top_k: how last.ckpt is written at the resumed run's save point (a copy, a link, its own save).
LAST_WRITES = {"copy": (True, 1), "link": ("link", 1), "own save": (True, 0)}


@pytest.mark.parametrize("write", sorted(LAST_WRITES))
@pytest.mark.parametrize("foreign", sorted(FOREIGN_LAST))
def test_a_state_naming_a_foreign_folder_as_last_never_deletes_it(tmp_path, foreign, write):
    save_last, top_k = LAST_WRITES[write]
    dirpath = tmp_path / "ckpts"

    def run(max_epochs, ckpt_path=None):
        callback = ModelCheckpoint(dirpath=dirpath, save_top_k=top_k, save_last=save_last, filename="{epoch}")
        trainer = phalanx.Trainer(
            max_epochs=max_epochs,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        trainer.fit(DecreasingValLoss(), ckpt_path=ckpt_path)
        return callback

    first = run(1)
    checkpoint = torch.load(first.last_model_path, weights_only=True)
    checkpoint["callbacks"][first.state_key]["last_model_path"] = str(dirpath / "last.ckpt")
    torch.save(checkpoint, tmp_path / "tampered.ckpt")
    os.unlink(dirpath / "last.ckpt")
    FOREIGN_LAST[foreign](dirpath / "last.ckpt")
    before = snapshot(tmp_path / "ckpts" / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"Refusing to write a checkpoint at .*last\.ckpt: a directory without"):
        run(2, ckpt_path=tmp_path / "tampered.ckpt")
    assert snapshot(tmp_path / "ckpts" / "last.ckpt") == before  # every entry of the folder, as it was
    assert (dirpath / "last.ckpt" / "payload").read_text() == "the user's data"
