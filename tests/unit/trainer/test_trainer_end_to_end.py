"""fit / validate / test / predict end to end on one CPU device, and the Trainer options that shape them."""

from __future__ import annotations

import math

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, regression_data, same_parameters
from torch.utils.data import DataLoader

import phalanx


def test_fit_validate_test_predict_end_to_end(tmp_path):
    phalanx.seed_everything(0)
    model = Regressor()
    train, val = loaders(n=64, batch_size=8)
    trainer = quiet_trainer(max_epochs=4, default_root_dir=tmp_path)
    before = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    trainer.fit(model, train, val)
    assert trainer.global_step == 4 * 8
    assert trainer.current_epoch == 4
    assert trainer.state.status == "finished"
    after = trainer.validate(model, val, verbose=False)
    assert set(after[0]) == {"val_loss"}
    assert after[0]["val_loss"] < before / 2
    tested = trainer.test(model, val, verbose=False)
    assert tested[0]["test_loss"] == pytest.approx(after[0]["val_loss"], rel=1e-5)
    predictions = trainer.predict(model, val)
    assert len(predictions) == 4 and predictions[0].shape == (16, 1)
    expected = model(regression_data(64).tensors[0][:16])
    assert torch.allclose(predictions[0], expected)


def test_trainer_properties_after_fit(tmp_path):
    model = Regressor()
    train, val = loaders()
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(model, train, val)
    assert trainer.global_rank == 0 and trainer.world_size == 1 and trainer.is_global_zero
    assert trainer.model is model and trainer.module is model
    assert trainer.log_dir == str(tmp_path)
    assert set(trainer.callback_metrics) >= {"train_loss", "val_loss"}
    assert isinstance(trainer.callback_metrics["val_loss"], torch.Tensor)
    assert set(trainer.progress_bar_metrics) == {"train_loss", "val_loss"}
    assert trainer.num_training_batches == 8 and trainer.num_val_batches == [4]
    assert trainer.estimated_stepping_batches == 8


def test_validation_metric_is_the_batch_size_weighted_mean(tmp_path):
    data = regression_data(20)
    val = DataLoader(data, batch_size=8)  # batches of 8, 8 and 4
    model = Regressor()
    result = quiet_trainer().validate(model, val, verbose=False)[0]["val_loss"]
    with torch.no_grad():
        x, y = data.tensors
        expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert result == pytest.approx(expected, rel=1e-5)


def test_log_options_on_step_on_epoch_and_reductions():
    class Logging(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("both", float(batch_idx), on_step=True, on_epoch=True, reduce_fx="sum")
            self.log("biggest", float(batch_idx), on_step=False, on_epoch=True, reduce_fx="max")
            self.log("hidden", 1.0, logger=False)
            return loss

    model = Logging()
    train, _ = loaders(n=32, batch_size=8)
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(model, train)
    metrics = trainer.callback_metrics
    assert metrics["both_step"].item() == 3.0
    assert metrics["both_epoch"].item() == 0 + 1 + 2 + 3
    assert metrics["both"].item() == 6.0
    assert metrics["biggest"].item() == 3.0
    assert "hidden" in metrics and "hidden" not in trainer.logged_metrics
    assert "both_step" in trainer.logged_metrics and "both_epoch" in trainer.logged_metrics


def test_log_rejects_bad_values():
    class BadLog(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("vector", torch.ones(3))
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="one element"):
        quiet_trainer(max_steps=1).fit(BadLog(), loaders()[0])

    class BadReduce(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, reduce_fx="median")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="mean"):
        quiet_trainer(max_steps=1).fit(BadReduce(), loaders()[0])


def test_multiple_validation_dataloaders_get_their_own_metrics():
    class TwoLoaders(Regressor):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_loss", float(dataloader_idx + 1))

    small = DataLoader(regression_data(16), batch_size=8)
    results = quiet_trainer().validate(TwoLoaders(), [small, small], verbose=False)
    assert results == [{"val_loss/dataloader_idx_0": 1.0}, {"val_loss/dataloader_idx_1": 2.0}]


def test_limits_and_val_check_interval_count_batches():
    calls: list[tuple[int, int]] = []

    class Counting(Regressor):
        def validation_step(self, batch, batch_idx):
            calls.append((self.trainer.global_step, batch_idx))

    train, val = loaders(n=80, batch_size=8)  # 10 batches
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=0.8, limit_val_batches=2, val_check_interval=0.25, num_sanity_val_steps=1
    )
    trainer.fit(Counting(), train, val)
    assert trainer.global_step == 8
    # sanity check (1 batch), then validation after batches 2, 4, 6 and at the end (8): 2 batches each
    assert calls == [(0, 0), (2, 0), (2, 1), (4, 0), (4, 1), (6, 0), (6, 1), (8, 0), (8, 1)]


def test_check_val_every_n_epoch_and_disabled_validation():
    epochs: list[int] = []

    class Counting(Regressor):
        def on_validation_epoch_start(self):
            epochs.append(self.current_epoch)

    train, val = loaders(n=16, batch_size=8)
    quiet_trainer(max_epochs=4, check_val_every_n_epoch=2, num_sanity_val_steps=0).fit(Counting(), train, val)
    assert epochs == [1, 3]
    epochs.clear()
    quiet_trainer(max_epochs=2, limit_val_batches=0).fit(Counting(), train, val)
    assert epochs == []


def test_int_val_check_interval_across_epochs():
    steps: list[int] = []

    class Counting(Regressor):
        def on_validation_epoch_start(self):
            steps.append(self.global_step)

    train, val = loaders(n=24, batch_size=8)  # 3 batches an epoch
    quiet_trainer(max_epochs=3, val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=0).fit(
        Counting(), train, val
    )
    assert steps == [4, 8]


def test_max_steps_max_epochs_and_min_epochs_with_stop_request():
    train, _ = loaders(n=64, batch_size=8)
    trainer = quiet_trainer(max_steps=5)
    trainer.fit(Regressor(), train)
    assert trainer.global_step == 5

    class StopEarly(phalanx.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = True

    trainer = quiet_trainer(max_epochs=10, min_epochs=3, callbacks=[StopEarly()])
    trainer.fit(Regressor(), train)
    assert trainer.current_epoch == 3  # the stop request waits for min_epochs


def test_max_time_stops_training():
    train, _ = loaders(n=64, batch_size=8)
    trainer = quiet_trainer(max_time={"seconds": 0.001}, max_epochs=1000)
    trainer.fit(Regressor(), train)
    assert 1 <= trainer.global_step < 1000 * 8


def test_fast_dev_run_runs_one_batch_of_each_and_saves_nothing(tmp_path):
    train, val = loaders()
    trainer = phalanx.Trainer(
        accelerator="cpu", fast_dev_run=True, default_root_dir=tmp_path, enable_progress_bar=False
    )
    trainer.fit(Regressor(), train, val)
    assert trainer.global_step == 1
    assert trainer.num_val_batches == [1]
    assert not list(tmp_path.rglob("*.ckpt")) and trainer.loggers == []


def test_accumulate_grad_batches_equals_large_batch_training():
    data = regression_data(32)
    phalanx.seed_everything(0)
    accumulated = Regressor()
    large = Regressor()
    large.load_state_dict(accumulated.state_dict())
    quiet_trainer(max_epochs=1, accumulate_grad_batches=4).fit(accumulated, DataLoader(data, batch_size=8))
    quiet_trainer(max_epochs=1).fit(large, DataLoader(data, batch_size=32))
    for a, b in zip(accumulated.parameters(), large.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_gradient_clipping_by_norm_and_value():
    seen: dict[str, float] = {}

    class Inspect(phalanx.Callback):
        def on_before_zero_grad(self, trainer, module, optimizer):
            grads = [p.grad for p in module.parameters()]
            seen["norm"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
            seen["max"] = max(g.abs().max().item() for g in grads)

    train, _ = loaders()
    quiet_trainer(max_steps=1, gradient_clip_val=0.01, callbacks=[Inspect()]).fit(Regressor(), train)
    assert seen["norm"] == pytest.approx(0.01, rel=1e-3)
    quiet_trainer(max_steps=1, gradient_clip_val=0.001, gradient_clip_algorithm="value", callbacks=[Inspect()]).fit(
        Regressor(), train
    )
    assert seen["max"] <= 0.001 + 1e-9


def test_lr_schedulers_step_by_interval_and_plateau():
    class Scheduled(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step", "frequency": 2}}

    train, val = loaders(n=32, batch_size=8)
    model = Scheduled(lr=1.0)
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(model, train)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5**2)  # 4 steps, every 2nd

    class Plateau(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1e-3)
            # Any improvement under 50% counts as a plateau, so the LR must drop after the first epochs.
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.1, threshold=0.5)
            return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"}

    trainer = quiet_trainer(max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(Plateau(), train, val)
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-3 * 0.1 * 0.5

    class MissingMetric(Plateau):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            config["monitor"] = "nope"
            return config

    with pytest.raises(ValueError, match="nope"):
        quiet_trainer(max_epochs=1).fit(MissingMetric(), train, val)


def test_manual_optimization_with_two_optimizers():
    class TwoOptimizers(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            first.zero_grad()
            second.zero_grad()
            self.manual_backward(loss)
            first.step()
            second.step()
            self.log("loss", loss)

        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[3].parameters(), lr=0.1),
            ]

    model = TwoOptimizers()
    before = parameters_of(model)
    train, _ = loaders(n=32, batch_size=8)
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(model, train)
    assert trainer.global_step == 8  # each optimizer step counts, as in Lightning
    assert not any(torch.equal(a, b) for a, b in zip(before, parameters_of(model)))


def test_automatic_optimization_rejects_two_optimizers_and_manual_rejects_clipping():
    class Two(Regressor):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(ValueError, match="automatic_optimization = False"):
        quiet_trainer(max_steps=1).fit(Two(), loaders()[0])

    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="clip_gradients"):
        quiet_trainer(max_steps=1, gradient_clip_val=1.0).fit(Manual(), loaders()[0])


def test_training_step_returning_none_skips_and_dict_with_loss_works():
    class Skipping(Regressor):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None
            return {"loss": super().training_step(batch, batch_idx), "extra": 1}

    model = Skipping()
    before = parameters_of(model)
    quiet_trainer(max_epochs=1).fit(model, loaders()[0])
    assert not same_parameters(before, parameters_of(model))

    class NoLoss(Regressor):
        def training_step(self, batch, batch_idx):
            return {"other": 1}

    with pytest.raises(ValueError, match="'loss'"):
        quiet_trainer(max_steps=1).fit(NoLoss(), loaders()[0])


def test_hooks_are_called_in_order():
    calls: list[str] = []
    hook_names = [
        "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_backward",
        "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
        "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
        "on_validation_epoch_end", "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
    ]  # fmt: skip

    class Recording(Regressor):
        pass

    for name in hook_names:
        setattr(Recording, name, (lambda hook: lambda self, *args: calls.append(hook))(name))
    train, val = loaders(n=8, batch_size=8)
    quiet_trainer(max_epochs=1, num_sanity_val_steps=0, limit_val_batches=1).fit(Recording(), train, val)
    assert calls == hook_names


def test_callback_hooks_receive_trainer_and_module_and_run_before_the_module():
    order: list[str] = []

    class Module(Regressor):
        def on_train_epoch_end(self):
            order.append("module")
            self.log("from_module", 3.0)

    class Reader(phalanx.Callback):
        def on_train_epoch_end(self, trainer, module):
            assert isinstance(trainer, phalanx.Trainer) and isinstance(module, Module)
            order.append(f"callback:{'from_module' in trainer.callback_metrics}")

    quiet_trainer(max_epochs=1, callbacks=[Reader()]).fit(Module(), loaders()[0])
    assert order == ["callback:False", "module"]  # as in Lightning (test_hook_order.py has every hook)


def test_configure_model_runs_inside_the_init_context_and_configure_callbacks_merges():
    created_on: list[torch.dtype] = []

    class Lazy(Regressor):
        def configure_model(self):
            if getattr(self, "extra", None) is None:
                self.extra = torch.nn.Linear(2, 2)
                created_on.append(self.extra.weight.dtype)

        def configure_callbacks(self):
            return [Marker()]

    class Marker(phalanx.Callback):
        seen = 0

        def on_fit_start(self, trainer, module):
            Marker.seen += 1

    trainer = quiet_trainer(max_steps=1, precision="64-true")
    trainer.fit(Lazy(), loaders()[0])
    assert created_on == [torch.float64]
    assert Marker.seen == 1


def test_datamodule_hooks_and_state(tmp_path):
    events: list[str] = []

    class Data(phalanx.DataModule):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            self.save_hyperparameters()
            self.counter = 0

        def prepare_data(self):
            events.append("prepare_data")

        def setup(self, stage):
            events.append(f"setup:{stage}")
            self.train, self.val = loaders(batch_size=self.hparams.batch_size)

        def teardown(self, stage):
            events.append(f"teardown:{stage}")

        def train_dataloader(self):
            return self.train

        def val_dataloader(self):
            return self.val

        def state_dict(self):
            return {"counter": 41}

        def load_state_dict(self, state):
            self.counter = state["counter"]

    trainer = quiet_trainer(max_epochs=1)
    data = Data()
    trainer.fit(Regressor(), datamodule=data)
    assert events == ["prepare_data", "setup:fit", "teardown:fit"]
    path = tmp_path / "with_datamodule.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["datamodule"] == {"counter": 41}
    assert checkpoint["datamodule_hyper_parameters"] == {"batch_size": 8}
    resumed = Data()
    quiet_trainer(max_epochs=2).fit(Regressor(), datamodule=resumed, ckpt_path=path)
    assert resumed.counter == 41


def test_unsized_iterable_training_data():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            data = regression_data(40)
            return iter(zip(data.tensors[0].split(8), data.tensors[1].split(8)))

    trainer = quiet_trainer(max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(Regressor(), Stream())
    assert math.isinf(trainer.num_training_batches)
    assert trainer.global_step == 4  # 5 batches an epoch: one full window of 3 and a flushed window of 2


def test_train_batch_start_returning_minus_one_ends_the_epoch():
    class Short(Regressor):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 2 else None

    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(Short(), loaders()[0])
    assert trainer.global_step == 4 and trainer.current_epoch == 2


def test_save_checkpoint_after_fit_and_before_any_run(tmp_path):
    trainer = quiet_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="call fit"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    trainer.fit(Regressor(), loaders()[0])
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    checkpoint = torch.load(tmp_path / "after.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 8 and checkpoint["epoch"] == 1
    assert {
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "loops",
        "callbacks",
        "rng_states",
        "hyper_parameters",
    } <= set(checkpoint)
    assert checkpoint["hyper_parameters"] == {"features": 4, "hidden": 16, "lr": 0.05, "dropout": 0.0}


def test_exception_in_training_step_reaches_callbacks_and_is_raised():
    seen: list[str] = []

    class Failing(Regressor):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    class Watch(phalanx.Callback):
        def on_exception(self, trainer, module, exception):
            seen.append(str(exception))

    trainer = quiet_trainer(max_steps=1, callbacks=[Watch()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), loaders()[0])
    assert seen == ["boom"] and trainer.state.status == "failed"


def test_validate_without_model_uses_best_checkpoint_of_fit(tmp_path):
    from phalanx.callbacks import ModelCheckpoint

    train, val = loaders()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    trainer = quiet_trainer(max_epochs=3, callbacks=[checkpoint], enable_checkpointing=True, num_sanity_val_steps=0)
    model = Regressor()
    trainer.fit(model, train, val)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # the current weights are now useless; 'best' must be reloaded
    result = trainer.validate(dataloaders=val, verbose=False)[0]["val_loss"]
    assert result == pytest.approx(checkpoint.best_model_score.item(), rel=1e-5)


def test_any_unused_argument_is_accepted_by_trainer_for_lightning_compat():
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=1, num_nodes=1, precision=32, plugins=None, callbacks=None, logger=False,
        max_epochs=1, min_epochs=0, max_steps=-1, max_time=None, limit_train_batches=1.0, limit_val_batches=1.0,
        limit_test_batches=1.0, limit_predict_batches=1.0, val_check_interval=1.0, check_val_every_n_epoch=1,
        num_sanity_val_steps=2, accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None,
        deterministic=False, default_root_dir=".", enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, log_every_n_steps=50, fast_dev_run=False, sync_batchnorm=False,
        use_distributed_sampler=True, benchmark=None, inference_mode=True,
    )  # fmt: skip
    assert trainer.precision == "32-true"


def test_inference_mode_flag_controls_evaluation_grad_mode():
    modes: list[bool] = []

    class Probe(Regressor):
        def validation_step(self, batch, batch_idx):
            modes.append(torch.is_inference_mode_enabled())

    val = loaders()[1]
    quiet_trainer().validate(Probe(), val, verbose=False)
    quiet_trainer(inference_mode=False).validate(Probe(), val, verbose=False)
    assert modes[0] is True and modes[-1] is False


def test_deterministic_sets_torch_flag():
    quiet_trainer(deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()


def test_evaluation_restores_each_submodules_training_mode():
    model = Regressor()
    model.net[0].eval()  # a frozen layer the user keeps in eval mode
    train, val = loaders()
    quiet_trainer(max_epochs=1, num_sanity_val_steps=1).fit(model, train, val)
    assert model.training and not model.net[0].training


def test_lbfgs_gets_its_closure_re_evaluated():
    evaluations: list[int] = []

    class WithLBFGS(Regressor):
        def training_step(self, batch, batch_idx):
            evaluations.append(batch_idx)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)

    model = WithLBFGS()
    train, val = loaders()
    trainer = quiet_trainer(max_epochs=2)
    before = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    trainer.fit(model, train)
    after = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    assert trainer.global_step == 16
    assert len(evaluations) > 16  # several closure evaluations per step
    assert after < before
