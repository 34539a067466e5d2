import math
import os
from types import SimpleNamespace

import pytest
import torch

from phalanx.callbacks import Callback, ModelCheckpoint
from phalanx.plugins.io import TorchCheckpointIO
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


class FakeStrategy:
    def __init__(self, is_global_zero=True):
        self.is_global_zero = is_global_zero
        self.removed = []
        self.broadcasts = []
        self.decisions = []
        self.checkpoint_io = TorchCheckpointIO()

    def broadcast(self, obj, src=0):
        self.broadcasts.append(obj)
        return obj

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision, all=True):
        self.decisions.append((decision, all))
        return decision

    def remove_checkpoint(self, path):
        self.removed.append(path)
        if self.is_global_zero and os.path.exists(path):
            os.remove(path)


class FakeLogger:
    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.after_save_calls = []

    def after_save_checkpoint(self, callback):
        self.after_save_calls.append(callback.best_model_path)


class FakeTrainer(SimpleNamespace):
    def __init__(self, root, **kwargs):
        defaults = dict(
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
            strategy=FakeStrategy(),
        )
        defaults.update(kwargs)
        super().__init__(**defaults)
        self.saved = []

    def save_checkpoint(self, filepath, weights_only=False):
        self.saved.append((filepath, weights_only))
        if self.strategy.is_global_zero:
            os.makedirs(os.path.dirname(filepath), exist_ok=True)
            torch.save({"global_step": self.global_step}, filepath)


def ckpt_files(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith(".ckpt"))


def run_validation_epochs(trainer, callback, values, key="val_loss", steps_per_epoch=10):
    for epoch, value in enumerate(values):
        trainer.current_epoch = epoch
        trainer.global_step = (epoch + 1) * steps_per_epoch
        trainer.callback_metrics = {key: torch.tensor(value)}
        callback.on_validation_end(trainer, None)
        callback.on_train_epoch_end(trainer, None)


# ---------------------------------------------------------------------- names


def test_default_filename_and_dirpath(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path)
    name = callback.format_checkpoint_name({"epoch": torch.tensor(0), "step": torch.tensor(100)})
    assert os.path.basename(name) == "epoch=0-step=100.ckpt"
    assert os.path.dirname(name) == os.path.realpath(tmp_path)


def test_metric_formatting_and_auto_insert(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{epoch:02d}-{val_loss:.2f}")
    name = callback.format_checkpoint_name({"epoch": 3, "val_loss": torch.tensor(0.1234)})
    assert os.path.basename(name) == "epoch=03-val_loss=0.12.ckpt"

    plain = ModelCheckpoint(dirpath=tmp_path, filename="model-{epoch}-{acc:.1f}", auto_insert_metric_name=False)
    assert os.path.basename(plain.format_checkpoint_name({"epoch": 7, "acc": 0.55})) == "model-7-0.6.ckpt"


def test_missing_template_metric_is_zero_and_version_suffix(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{missing}")
    assert os.path.basename(callback.format_checkpoint_name({"epoch": 1})) == "epoch=1-missing=0.ckpt"
    assert os.path.basename(callback.format_checkpoint_name({"epoch": 1}, ver=2)) == "epoch=1-missing=0-v2.ckpt"
    assert os.path.basename(callback.format_checkpoint_name({}, filename="last")) == "last.ckpt"


def test_slash_in_metric_name_stays_in_dirpath(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val/loss:.3f}")
    name = callback.format_checkpoint_name({"epoch": 2, "val/loss": torch.tensor(0.5)})
    assert os.path.dirname(name) == os.path.realpath(tmp_path)
    assert os.path.basename(name) == "epoch=2-val_loss=0.500.ckpt"


def test_slash_metric_monitored_end_to_end(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{val/acc:.2f}", monitor="val/acc", mode="max")
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, [0.5, 0.7], key="val/acc")
    assert ckpt_files(tmp_path / "ck") == ["val_acc=0.70.ckpt"]


def test_version_counter_for_preexisting_file(tmp_path):
    (tmp_path / "epoch=0-step=10.ckpt").write_bytes(b"from an earlier run")
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path)
    with pytest.warns(UserWarning, match="not empty"):
        callback.setup(trainer, None, "fit")
    trainer.global_step = 10
    callback.on_validation_end(trainer, None)
    assert callback.best_model_path == os.path.join(os.path.realpath(tmp_path), "epoch=0-step=10-v1.ckpt")
    assert (tmp_path / "epoch=0-step=10.ckpt").read_bytes() == b"from an earlier run"
    assert ckpt_files(tmp_path) == ["epoch=0-step=10-v1.ckpt", "epoch=0-step=10.ckpt"]


def test_version_counter_disabled_overwrites(tmp_path):
    (tmp_path / "epoch=0-step=10.ckpt").write_bytes(b"old")
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path, enable_version_counter=False)
    with pytest.warns(UserWarning, match="not empty"):
        callback.setup(trainer, None, "fit")
    trainer.global_step = 10
    callback.on_validation_end(trainer, None)
    assert ckpt_files(tmp_path) == ["epoch=0-step=10.ckpt"]
    assert (tmp_path / "epoch=0-step=10.ckpt").read_bytes() != b"old"


# ---------------------------------------------------------------------- dirpath


def test_dirpath_defaults(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint()
    callback.setup(trainer, None, "fit")
    assert callback.dirpath == os.path.join(os.path.realpath(tmp_path), "checkpoints")
    assert trainer.strategy.broadcasts == [callback.dirpath]

    logger = FakeLogger(str(tmp_path / "logs" / "version_3"))
    trainer = FakeTrainer(tmp_path, loggers=[logger], log_dir=logger.log_dir)
    callback = ModelCheckpoint()
    callback.setup(trainer, None, "fit")
    assert callback.dirpath == os.path.join(os.path.realpath(tmp_path), "logs", "version_3", "checkpoints")


def test_dirpath_taken_from_rank_zero(tmp_path):
    class RankOneStrategy(FakeStrategy):
        def broadcast(self, obj, src=0):
            return "/rank/zero/checkpoints"

    trainer = FakeTrainer(tmp_path, strategy=RankOneStrategy(is_global_zero=False), is_global_zero=False)
    callback = ModelCheckpoint()
    callback.setup(trainer, None, "fit")
    assert callback.dirpath == "/rank/zero/checkpoints"


# ---------------------------------------------------------------------- top k


@pytest.mark.parametrize(
    ("mode", "values", "expected_kept", "best"),
    [
        ("min", [0.5, 0.3, 0.4, 0.6, 0.1], {0.3, 0.1}, 0.1),
        ("max", [0.5, 0.3, 0.4, 0.6, 0.1], {0.5, 0.6}, 0.6),
    ],
)
def test_top_k_files_on_disk(tmp_path, mode, values, expected_kept, best):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}-{val_loss:.1f}", monitor="val_loss", mode=mode, save_top_k=2
    )
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, values)

    kept = {f"val_loss={v:.1f}" for v in expected_kept}
    on_disk = ckpt_files(tmp_path)
    assert len(on_disk) == 2
    assert {name.split("-", 1)[1][: -len(".ckpt")] for name in on_disk} == kept
    assert set(callback.best_k_models) == {os.path.join(os.path.realpath(tmp_path), n) for n in on_disk}
    assert callback.best_model_score.item() == pytest.approx(best)
    assert f"val_loss={best:.1f}" in callback.best_model_path
    worst_kept = max(expected_kept) if mode == "min" else min(expected_kept)
    assert f"val_loss={worst_kept:.1f}" in callback.kth_best_model_path
    assert callback.kth_value.item() == pytest.approx(worst_kept)
    # Every removed file was one the callback had written.
    assert all(path.startswith(os.path.realpath(tmp_path)) for path in trainer.strategy.removed)


def test_save_top_k_all_and_none(tmp_path):
    trainer = FakeTrainer(tmp_path)
    keep_all = ModelCheckpoint(dirpath=tmp_path / "all", monitor="val_loss", save_top_k=-1)
    keep_all.setup(trainer, None, "fit")
    run_validation_epochs(trainer, keep_all, [0.5, 0.6, 0.4])
    assert len(ckpt_files(tmp_path / "all")) == 3
    assert keep_all.best_model_score.item() == pytest.approx(0.4)

    trainer = FakeTrainer(tmp_path)
    keep_none = ModelCheckpoint(dirpath=tmp_path / "none", monitor="val_loss", save_top_k=0, save_last=True)
    keep_none.setup(trainer, None, "fit")
    run_validation_epochs(trainer, keep_none, [0.5, 0.6])
    assert ckpt_files(tmp_path / "none") == ["last.ckpt"]
    assert keep_none.best_model_path == ""


def test_no_monitor_keeps_newest_only(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path)
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, [1.0, 2.0, 3.0])
    assert ckpt_files(tmp_path) == ["epoch=2-step=30.ckpt"]
    assert callback.best_model_path.endswith("epoch=2-step=30.ckpt")


def test_non_finite_values_rank_worst(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_acc", mode="max", save_top_k=2)
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, [float("nan")], key="val_acc")
    # As in Lightning: NaN is stored as the worst value, and the only checkpoint kept is the best there is.
    assert callback.best_model_score.item() == -math.inf and callback.best_model_path.endswith(".ckpt")
    run_validation_epochs(trainer, callback, [float("nan"), 0.2], key="val_acc")
    assert callback.best_model_score.item() == pytest.approx(0.2)
    trainer.current_epoch, trainer.global_step = 5, 60
    trainer.callback_metrics = {"val_acc": torch.tensor(math.inf)}
    callback.on_validation_end(trainer, None)
    assert callback.best_model_score.item() == pytest.approx(0.2)
    assert "epoch=5" not in callback.best_model_path


def test_missing_monitor_lists_available_keys(tmp_path):
    trainer = FakeTrainer(tmp_path, callback_metrics={"train_loss": torch.tensor(1.0), "val_acc": torch.tensor(0.5)})
    trainer.global_step = 5
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    callback.setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="val_loss") as error:
        callback.on_validation_end(trainer, None)
    assert "train_loss" in str(error.value) and "val_acc" in str(error.value)


# ---------------------------------------------------------------------- when to save


def test_save_last_writes_full_copy(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True)
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, [0.5, 0.7])
    assert ckpt_files(tmp_path) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    last = tmp_path / "last.ckpt"
    assert not last.is_symlink()
    assert torch.load(last)["global_step"] == 20
    assert callback.last_model_path == os.path.join(os.path.realpath(tmp_path), "last.ckpt")
    # Step 10 (top-k kept it): last.ckpt is a copy of that file; step 20 (not kept): its own save.
    assert [path for path, _ in trainer.saved].count(callback.last_model_path) == 1


def test_every_n_train_steps(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    callback.setup(trainer, None, "fit")
    for step in range(1, 8):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
        # accumulation: another batch end at the same step must not save again
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
    callback.on_validation_end(trainer, None)
    callback.on_train_epoch_end(trainer, None)
    assert [os.path.basename(p) for p, _ in trainer.saved] == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]


def test_every_n_epochs_and_train_epoch_end(tmp_path):
    trainer = FakeTrainer(tmp_path, validation_enabled=False)
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_top_k=-1)
    callback.setup(trainer, None, "fit")
    for epoch in range(4):
        trainer.current_epoch, trainer.global_step = epoch, (epoch + 1) * 10
        callback.on_validation_end(trainer, None)  # validation is not enabled: ignored
        callback.on_train_epoch_end(trainer, None)
    assert [os.path.basename(p) for p, _ in trainer.saved] == ["epoch=1-step=20.ckpt", "epoch=3-step=40.ckpt"]


def test_save_on_train_epoch_end_flag(tmp_path):
    trainer = FakeTrainer(tmp_path, validation_enabled=True)
    callback = ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=True)
    callback.setup(trainer, None, "fit")
    trainer.global_step = 10
    callback.on_validation_end(trainer, None)
    assert trainer.saved == []
    callback.on_train_epoch_end(trainer, None)
    assert len(trainer.saved) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"sanity_checking": True},
        {"fast_dev_run": 1},
        {"state": SimpleNamespace(fn="validate")},
        {"global_step": 0},
    ],
)
def test_never_saves_in_these_situations(tmp_path, change):
    trainer = FakeTrainer(tmp_path, global_step=10)
    for key, value in change.items():
        setattr(trainer, key, value)
    callback = ModelCheckpoint(dirpath=tmp_path)
    callback.setup(trainer, None, "fit")
    callback.on_validation_end(trainer, None)
    callback.on_train_epoch_end(trainer, None)
    assert trainer.saved == []


def test_weights_only_and_logger_notified(tmp_path):
    logger = FakeLogger(str(tmp_path))
    trainer = FakeTrainer(tmp_path, loggers=[logger], log_dir=str(tmp_path), global_step=4)
    callback = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)
    callback.setup(trainer, None, "fit")
    callback.on_validation_end(trainer, None)
    assert trainer.saved == [(callback.best_model_path, True)]
    assert logger.after_save_calls == [callback.best_model_path]


# ---------------------------------------------------------------------- state


def test_state_dict_round_trip(tmp_path):
    trainer = FakeTrainer(tmp_path)
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    callback.setup(trainer, None, "fit")
    run_validation_epochs(trainer, callback, [0.5, 0.3, 0.4])
    state = callback.state_dict()
    # Only plain values and tensors (checkpoints are loaded with weights_only=True).
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)

    restored = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    restored.load_state_dict(loaded)
    assert restored.best_model_path == callback.best_model_path
    assert restored.best_model_score.item() == pytest.approx(0.3)
    assert restored.best_k_models.keys() == callback.best_k_models.keys()
    assert restored.kth_best_model_path == callback.kth_best_model_path
    assert restored.kth_value.item() == pytest.approx(0.4)
    assert restored.last_model_path == callback.last_model_path

    # Resuming overwrites last.ckpt rather than versioning it, and keeps the top-k ranking.
    trainer2 = FakeTrainer(tmp_path)
    with pytest.warns(UserWarning, match="not empty"):
        restored.setup(trainer2, None, "fit")
    run_validation_epochs(trainer2, restored, [0.9, 0.9, 0.9, 0.2])
    assert "last.ckpt" in ckpt_files(tmp_path) and not any("last-v" in n for n in ckpt_files(tmp_path))
    assert restored.best_model_score.item() == pytest.approx(0.2)
    assert len([n for n in ckpt_files(tmp_path) if n != "last.ckpt"]) == 2


def test_state_from_other_dirpath_restores_best_path_only(tmp_path):
    old = ModelCheckpoint(dirpath=tmp_path / "old", monitor="val_loss")
    old.best_model_path = str(tmp_path / "old" / "x.ckpt")
    old.best_k_models = {old.best_model_path: torch.tensor(0.1)}
    new = ModelCheckpoint(dirpath=tmp_path / "new", monitor="val_loss")
    with pytest.warns(UserWarning, match="changed"):
        new.load_state_dict(old.state_dict())
    assert new.best_model_path == old.best_model_path
    assert new.best_k_models == {}


def test_state_key_differs_by_settings():
    a = ModelCheckpoint(monitor="val_loss")
    b = ModelCheckpoint(monitor="val_acc", mode="max")
    assert a.state_key != b.state_key
    assert a.state_key == ModelCheckpoint(monitor="val_loss").state_key
    assert isinstance(a, Callback)


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "avg"}, "min"),
        ({"save_top_k": -2}, ">= -1"),
        ({"save_top_k": 3}, "monitor"),
        ({"every_n_train_steps": -1}, "every_n_train_steps"),
        ({"every_n_epochs": 1.5}, "every_n_epochs"),
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, "mutually exclusive"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelCheckpoint(**kwargs)


def test_class_constants():
    assert ModelCheckpoint.CHECKPOINT_NAME_LAST == "last"
    assert ModelCheckpoint.FILE_EXTENSION == ".ckpt"


# ---------------------------------------------------------------------- with the real Trainer

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402


class ScriptedValLoss(phalanx.TrainingModule):
    """Trains a Linear layer; validation reports a scripted loss per epoch."""

    def __init__(self, val_losses):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.val_losses = val_losses

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(self.val_losses[self.current_epoch]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)


def make_real_trainer(tmp_path, callbacks, max_epochs):
    return phalanx.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


def test_fit_keeps_the_best_checkpoints(tmp_path):
    losses = [0.5, 0.3, 0.4, 0.2, 0.6]
    callback = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{val_loss:.2f}")
    trainer = make_real_trainer(tmp_path, [callback], max_epochs=5)
    trainer.fit(ScriptedValLoss(losses))

    assert trainer.checkpoint_callback is callback
    assert callback.dirpath == os.path.join(os.path.realpath(tmp_path), "checkpoints")
    assert os.path.isfile(callback.best_model_path)
    assert os.path.basename(callback.best_model_path) == "epoch=3-val_loss=0.20.ckpt"
    assert callback.best_model_score.item() == pytest.approx(min(losses))
    assert ckpt_files(callback.dirpath) == ["epoch=1-val_loss=0.30.ckpt", "epoch=3-val_loss=0.20.ckpt", "last.ckpt"]
    checkpoint = torch.load(callback.best_model_path, weights_only=True)
    assert checkpoint["callbacks"][callback.state_key]["best_model_path"] == callback.best_model_path


def test_resume_continues_top_k_and_overwrites_last(tmp_path):
    losses = [0.5, 0.3, 0.4, 0.2, 0.6, 0.1]
    first = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{val_loss:.2f}")
    make_real_trainer(tmp_path, [first], max_epochs=3).fit(ScriptedValLoss(losses))
    assert ckpt_files(first.dirpath) == ["epoch=1-val_loss=0.30.ckpt", "epoch=2-val_loss=0.40.ckpt", "last.ckpt"]

    second = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{val_loss:.2f}")
    with pytest.warns(UserWarning, match="not empty"):
        make_real_trainer(tmp_path, [second], max_epochs=6).fit(
            ScriptedValLoss(losses), ckpt_path=first.last_model_path
        )
    assert ckpt_files(second.dirpath) == ["epoch=3-val_loss=0.20.ckpt", "epoch=5-val_loss=0.10.ckpt", "last.ckpt"]
    assert second.best_model_score.item() == pytest.approx(0.1)
