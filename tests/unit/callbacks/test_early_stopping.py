import math
from types import SimpleNamespace

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import EarlyStopping
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


class FakeStrategy:
    def __init__(self, others_want_stop=False):
        self.others_want_stop = others_want_stop
        self.calls = []

    def reduce_boolean_decision(self, decision, all=True):
        self.calls.append((decision, all))
        return decision or self.others_want_stop if not all else decision and not self.others_want_stop


def make_trainer(**kwargs):
    defaults = dict(
        callback_metrics={},
        current_epoch=0,
        global_rank=0,
        world_size=1,
        should_stop=False,
        sanity_checking=False,
        fast_dev_run=False,
        validation_enabled=True,
        state=SimpleNamespace(fn="fit"),
        strategy=FakeStrategy(),
    )
    defaults.update(kwargs)
    return SimpleNamespace(**defaults)


def feed(callback, trainer, values, key="val_loss"):
    """Run one validation check per value; return the epoch at which should_stop became True (or None)."""
    for epoch, value in enumerate(values):
        trainer.current_epoch = epoch
        trainer.callback_metrics = {key: torch.tensor(value)}
        callback.on_validation_end(trainer, None)
        callback.on_train_epoch_end(trainer, None)
        if trainer.should_stop:
            return epoch
    return None


def test_patience_in_min_mode():
    callback = EarlyStopping(monitor="val_loss", patience=2)
    trainer = make_trainer()
    stopped = feed(callback, trainer, [1.0, 0.9, 0.95, 0.91, 0.8])
    assert stopped == 3
    assert callback.stopped_epoch == 3
    assert callback.wait_count == 2
    assert callback.best_score.item() == pytest.approx(0.9)
    assert "did not improve" in callback.stopping_reason_message
    assert trainer.strategy.calls[-1] == (True, False)  # any rank may stop everyone


def test_improvement_resets_wait_count():
    callback = EarlyStopping(monitor="val_loss", patience=2)
    trainer = make_trainer()
    assert feed(callback, trainer, [1.0, 1.1, 0.5, 0.6]) is None
    assert callback.wait_count == 1
    assert callback.best_score.item() == pytest.approx(0.5)


def test_max_mode():
    callback = EarlyStopping(monitor="acc", mode="max", patience=1)
    trainer = make_trainer()
    assert feed(callback, trainer, [0.1, 0.2, 0.3, 0.25], key="acc") == 3
    assert callback.best_score.item() == pytest.approx(0.3)


def test_min_delta_counts_small_changes_as_no_improvement():
    callback = EarlyStopping(monitor="val_loss", min_delta=0.1, patience=2)
    trainer = make_trainer()
    # 0.95 and 0.92 improve by less than 0.1: not improvements
    assert feed(callback, trainer, [1.0, 0.95, 0.92]) == 2
    assert callback.best_score.item() == pytest.approx(1.0)

    callback = EarlyStopping(monitor="acc", mode="max", min_delta=0.1, patience=1)
    trainer = make_trainer()
    assert feed(callback, trainer, [0.1, 0.25, 0.3], key="acc") == 2
    assert callback.best_score.item() == pytest.approx(0.25)


def test_stopping_threshold():
    callback = EarlyStopping(monitor="val_loss", stopping_threshold=0.5, patience=100)
    trainer = make_trainer()
    assert feed(callback, trainer, [1.0, 0.7, 0.4, 0.3]) == 2
    assert "Stopping threshold" in callback.stopping_reason_message
    assert callback.stopping_reason == "stopping_threshold"


def test_divergence_threshold():
    callback = EarlyStopping(monitor="val_loss", divergence_threshold=5.0, patience=100)
    trainer = make_trainer()
    assert feed(callback, trainer, [1.0, 3.0, 6.0]) == 2
    assert "Divergence threshold" in callback.stopping_reason_message


def test_non_finite_stops_only_with_check_finite():
    callback = EarlyStopping(monitor="val_loss", patience=100)
    trainer = make_trainer()
    assert feed(callback, trainer, [1.0, math.nan]) == 1
    assert "not finite" in callback.stopping_reason_message

    callback = EarlyStopping(monitor="val_loss", patience=100, check_finite=False)
    trainer = make_trainer()
    assert feed(callback, trainer, [1.0, math.nan, math.inf]) is None
    assert callback.wait_count == 2
    assert callback.best_score.item() == pytest.approx(1.0)


def test_other_rank_decision_stops_this_rank():
    callback = EarlyStopping(monitor="val_loss", patience=100)
    trainer = make_trainer(strategy=FakeStrategy(others_want_stop=True))
    assert feed(callback, trainer, [1.0]) == 0
    assert callback.stopped_epoch == 0


def test_should_stop_already_true_is_kept():
    callback = EarlyStopping(monitor="val_loss", patience=100)
    trainer = make_trainer(should_stop=True)
    trainer.callback_metrics = {"val_loss": torch.tensor(1.0)}
    callback.on_validation_end(trainer, None)
    assert trainer.should_stop is True


def test_missing_monitor_strict_and_not_strict():
    trainer = make_trainer(callback_metrics={"train_loss": torch.tensor(1.0), "val_acc": torch.tensor(0.3)})
    callback = EarlyStopping(monitor="val_loss")
    with pytest.raises(RuntimeError, match="val_loss") as error:
        callback.on_validation_end(trainer, None)
    assert "train_loss" in str(error.value) and "val_acc" in str(error.value)

    lenient = EarlyStopping(monitor="val_loss", strict=False)
    lenient.on_validation_end(trainer, None)
    assert trainer.should_stop is False


def test_where_the_check_runs():
    # validation enabled: after validation, not at train epoch end
    callback = EarlyStopping(monitor="val_loss", patience=0)
    trainer = make_trainer(callback_metrics={"val_loss": torch.tensor(1.0)})
    callback.on_train_epoch_end(trainer, None)
    assert callback.best_score.item() == math.inf
    callback.on_validation_end(trainer, None)
    assert callback.best_score.item() == 1.0

    # no validation: at train epoch end
    callback = EarlyStopping(monitor="train_loss")
    trainer = make_trainer(validation_enabled=False, callback_metrics={"train_loss": torch.tensor(2.0)})
    callback.on_validation_end(trainer, None)
    assert callback.best_score.item() == math.inf
    callback.on_train_epoch_end(trainer, None)
    assert callback.best_score.item() == 2.0

    # forced to train epoch end
    callback = EarlyStopping(monitor="val_loss", check_on_train_epoch_end=True)
    trainer = make_trainer(callback_metrics={"val_loss": torch.tensor(3.0)})
    callback.on_validation_end(trainer, None)
    assert callback.best_score.item() == math.inf
    callback.on_train_epoch_end(trainer, None)
    assert callback.best_score.item() == 3.0


@pytest.mark.parametrize(
    "change", [{"sanity_checking": True}, {"state": SimpleNamespace(fn="validate")}, {"fast_dev_run": 1}]
)
def test_no_check_during_sanity_check_or_outside_fit(change):
    callback = EarlyStopping(monitor="val_loss", patience=0)
    trainer = make_trainer(callback_metrics={"val_loss": torch.tensor(math.nan)}, **change)
    callback.on_validation_end(trainer, None)
    callback.on_train_epoch_end(trainer, None)
    assert trainer.should_stop is False
    assert callback.wait_count == 0


def test_state_round_trip():
    callback = EarlyStopping(monitor="val_loss", patience=5)
    trainer = make_trainer()
    feed(callback, trainer, [1.0, 0.5, 0.7, 0.8])
    state = callback.state_dict()
    restored = EarlyStopping(monitor="val_loss", patience=5)
    restored.load_state_dict(state)
    assert restored.wait_count == 2
    assert restored.best_score.item() == pytest.approx(0.5)
    assert restored.patience == 5
    # continues counting where it left off
    trainer = make_trainer()
    assert feed(restored, trainer, [0.9, 0.9, 0.9]) == 2
    assert restored.state_key == callback.state_key
    assert restored.state_key != EarlyStopping(monitor="val_loss", mode="max").state_key


def test_invalid_mode():
    with pytest.raises(ValueError, match="min"):
        EarlyStopping(monitor="x", mode="lowest")


# ---------------------------------------------------------------------- with the real Trainer

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402


class FlatValLoss(phalanx.TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.epochs_started = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_epoch_start(self):
        self.epochs_started += 1

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(1.0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)


def test_fit_stops_early_on_a_flat_metric(tmp_path):
    callback = EarlyStopping(monitor="val_loss", patience=2)
    trainer = phalanx.Trainer(
        max_epochs=20,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    module = FlatValLoss()
    trainer.fit(module)
    assert trainer.early_stopping_callback is callback
    # epoch 0 sets the best; epochs 1 and 2 do not improve: stop after epoch 2
    assert callback.stopped_epoch == 2
    assert module.epochs_started == 3
    assert trainer.should_stop
    assert "did not improve" in callback.stopping_reason_message


class NaNFromEpochOne(Regressor):
    """Its training loss (logged as train_loss) is NaN from epoch 1 on."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch >= 1:
            loss = loss * math.nan
            self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("check_finite", [True, False])
def test_check_finite_stops_a_real_fit_whose_metric_turns_nan(check_finite):
    callback = EarlyStopping(monitor="train_loss", patience=100, check_finite=check_finite)
    trainer = quiet_trainer(max_epochs=4, callbacks=[callback], nonfinite_loss="ignore")
    trainer.fit(NaNFromEpochOne(), loaders()[0])
    if check_finite:
        assert trainer.should_stop and trainer.current_epoch == 2  # stopped at the end of epoch 1
        assert callback.stopping_reason == "non_finite_metric" and callback.stopped_epoch == 1
        assert "train_loss = nan is not finite" in callback.stopping_reason_message
    else:
        assert trainer.current_epoch == 4 and callback.stopping_reason == "not_stopped"
        assert callback.wait_count == 3  # NaN never counts as an improvement


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"wait_count": None}, "lacks \\['wait_count'\\]"),
        ({"patience": -1}, "'patience' is -1"),
        ({"stopped_epoch": "3"}, "'stopped_epoch' is '3'"),
        ({"best_score": "low"}, "'best_score' is a str"),
        ({"best_score": torch.ones(2)}, "'best_score' is a Tensor"),
    ],
)
def test_a_damaged_state_is_refused_before_anything_changes(change, message):
    state = EarlyStopping(monitor="val_loss", patience=5).state_dict()
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    callback = EarlyStopping(monitor="val_loss", patience=7)
    with pytest.raises(CheckpointError, match=message):
        callback.load_state_dict(state)
    assert callback.patience == 7 and callback.wait_count == 0 and callback.best_score.item() == math.inf
