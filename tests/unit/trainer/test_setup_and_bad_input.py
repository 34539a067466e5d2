"""Trainer argument resolution, and bad input that must fail with a message naming the problem and the choices."""

from __future__ import annotations

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.accelerators import CPUAccelerator, CUDAAccelerator
from phalanx.plugins import DoublePrecision, HalfPrecision, MixedPrecision, Precision, TorchCheckpointIO
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.resolve import normalize_precision, resolve_strategy
from phalanx.utilities.exceptions import CheckpointError, UnsafeCheckpointError


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (32, "32-true"),
        ("32", "32-true"),
        (64, "64-true"),
        (16, "16-mixed"),
        ("bf16", "bf16-mixed"),
        ("bf16-true", "bf16-true"),
    ],
)
def test_precision_aliases(given, expected):
    assert normalize_precision(given) == expected


@pytest.mark.parametrize(
    ("precision", "plugin_type", "dtype"),
    [
        ("32-true", Precision, torch.float32),
        ("64-true", DoublePrecision, torch.float64),
        ("bf16-mixed", MixedPrecision, torch.float32),
        ("bf16-true", HalfPrecision, torch.bfloat16),
        ("16-true", HalfPrecision, torch.float16),
    ],
)
def test_each_precision_trains_on_cpu(precision, plugin_type, dtype):
    trainer = quiet_trainer(max_steps=2, precision=precision)
    assert type(trainer.strategy.precision_plugin) is plugin_type
    model = Regressor()
    trainer.fit(model, loaders()[0])
    assert model.net[0].weight.dtype == dtype
    assert trainer.global_step == 2


def test_16_mixed_on_cpu_falls_back_to_bf16_with_a_warning():
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = quiet_trainer(precision="16-mixed")
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_auto_resolves_to_single_cpu_device():
    strategy = resolve_strategy(accelerator="auto", strategy="auto", devices="auto")
    assert isinstance(strategy, SingleDeviceStrategy)
    assert isinstance(strategy.accelerator, CPUAccelerator)
    assert strategy.root_device == torch.device("cpu")
    assert isinstance(strategy.checkpoint_io, TorchCheckpointIO)


def test_plugins_are_attached_to_the_strategy():
    io = TorchCheckpointIO()
    precision = DoublePrecision()
    strategy = resolve_strategy(accelerator="cpu", plugins=[io, precision])
    assert strategy.checkpoint_io is io and strategy.precision_plugin is precision


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"strategy": "nonsense"}, ValueError, "single_device"),
        ({"accelerator": "tpu"}, ValueError, "cpu"),
        ({"accelerator": "cuda"}, ValueError, "not available"),
        ({"accelerator": "gpu"}, ValueError, "accelerator='cpu'"),
        ({"precision": "8-true"}, ValueError, "bf16-mixed"),
        ({"precision": True}, ValueError, "32-true"),
        ({"devices": 0}, ValueError, ">= 1"),
        ({"devices": "many"}, ValueError, "positive int"),
        ({"devices": [0, 1]}, ValueError, "positive int"),
        ({"devices": 2, "strategy": "single_device"}, ValueError, "one process"),
        ({"num_nodes": 0}, ValueError, "num_nodes"),
        ({"plugins": ["fp16"]}, TypeError, "Precision, CheckpointIO, ClusterEnvironment and LayerSync"),
        ({"plugins": [Precision(), DoublePrecision()]}, ValueError, "more than one"),
        ({"plugins": [DoublePrecision()], "precision": "bf16-mixed"}, ValueError, "only one"),
        ({"strategy": 3}, TypeError, "Strategy instance"),
        ({"max_epochs": -2}, ValueError, "max_epochs"),
        ({"max_steps": 1.5}, ValueError, "max_steps"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches"),
        ({"limit_train_batches": 1.5}, ValueError, "fraction"),
        ({"limit_val_batches": -1}, ValueError, ">= 0"),
        ({"limit_test_batches": "all"}, TypeError, "int"),
        ({"val_check_interval": 0}, ValueError, "val_check_interval"),
        ({"val_check_interval": 1.5}, ValueError, "fraction of an epoch"),
        ({"gradient_clip_val": -1}, ValueError, "gradient_clip_val"),
        ({"gradient_clip_algorithm": "l2"}, ValueError, "'norm' or 'value'"),
        ({"max_time": "1 hour"}, ValueError, "DD:HH:MM:SS"),
        ({"fast_dev_run": -1}, ValueError, "fast_dev_run"),
        ({"deterministic": "yes"}, ValueError, "'warn'"),
        ({"logger": "csv"}, TypeError, "Logger"),
        ({"callbacks": [object()]}, TypeError, "Callback"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
    ],
)
def test_bad_trainer_arguments_raise_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        phalanx.Trainer(**kwargs)


def test_out_of_range_gpu_id_and_bf16_on_old_gpu_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"valid indices are \[0, 1\]"):
        CUDAAccelerator.parse_devices([3])
    assert CUDAAccelerator.parse_devices("0,1") == [0, 1]
    assert CUDAAccelerator.parse_devices(-1) == [0, 1]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    with pytest.raises(ValueError, match="cannot run on the cuda accelerator"):
        resolve_strategy(accelerator="cuda", devices=[1], precision="bf16-mixed")
    strategy = resolve_strategy(accelerator="cuda", devices=[1], precision="16-mixed")
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.precision_plugin.scaler is not None


def test_fit_input_errors():
    trainer = quiet_trainer(max_steps=1)
    with pytest.raises(TypeError, match="TrainingModule"):
        trainer.fit(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="needs training data"):
        trainer.fit(Regressor())
    with pytest.raises(ValueError, match="not both"):
        trainer.fit(Regressor(), loaders()[0], datamodule=phalanx.DataModule())
    with pytest.raises(TypeError, match="DataModule"):
        trainer.fit(Regressor(), datamodule=object())
    with pytest.raises(ValueError, match="needs a model"):
        quiet_trainer().validate()


def test_missing_training_step_and_configure_optimizers():
    class NoStep(phalanx.TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(NotImplementedError, match="training_step"):
        quiet_trainer(max_steps=1).fit(NoStep(), loaders()[0])

    class NoOptimizer(Regressor):
        configure_optimizers = phalanx.TrainingModule.configure_optimizers

    with pytest.raises(NotImplementedError, match="configure_optimizers"):
        quiet_trainer(max_steps=1).fit(NoOptimizer(), loaders()[0])
    with pytest.raises(ValueError, match="validation_step"):
        quiet_trainer().validate(NoStep(), loaders()[1])


@pytest.mark.parametrize(
    "returned",
    [None, "sgd", 3, [], {"optimiser": 1}, {"optimizer": "sgd"}, ([torch.nn.Linear(1, 1)], [])],
)
def test_unusable_configure_optimizers_results(returned):
    class Bad(Regressor):
        def configure_optimizers(self):
            return returned

    with pytest.raises((TypeError, ValueError), match="configure_optimizers|optimizer"):
        quiet_trainer(max_steps=1).fit(Bad(), loaders()[0])


def test_ckpt_path_errors(tmp_path):
    trainer = quiet_trainer(max_steps=1)
    with pytest.raises(FileNotFoundError, match="not found"):
        trainer.fit(Regressor(), loaders()[0], ckpt_path=tmp_path / "missing.ckpt")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        trainer.fit(Regressor(), loaders()[0], ckpt_path=garbage)
    not_phalanx = tmp_path / "plain.ckpt"
    torch.save({"weights": torch.ones(1)}, not_phalanx)
    with pytest.raises(CheckpointError, match="state_dict"):
        trainer.fit(Regressor(), loaders()[0], ckpt_path=not_phalanx)
    with pytest.raises(ValueError, match="ModelCheckpoint"):
        trainer.fit(Regressor(), loaders()[0], ckpt_path="best")
    with pytest.raises(TypeError, match="ckpt_path"):
        trainer.fit(Regressor(), loaders()[0], ckpt_path=3)


class _Payload:
    """Stands for any object that a malicious or careless checkpoint could smuggle in."""

    def __init__(self) -> None:
        self.value = 1


def test_checkpoint_needing_arbitrary_unpickling_is_refused_and_nothing_is_loaded(tmp_path):
    model = Regressor()
    path = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": Regressor().state_dict(), "extra": _Payload()}, path)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(UnsafeCheckpointError, match="_Payload") as raised:
        quiet_trainer(max_steps=1).fit(model, loaders()[0], ckpt_path=path)
    assert "weights_only" in str(raised.value) and "arbitrary" in str(raised.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(UnsafeCheckpointError):
        Regressor.load_from_checkpoint(path)


def test_saving_a_checkpoint_with_a_non_plain_object_is_refused_before_writing(tmp_path):
    class Sneaky(Regressor):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["payload"] = _Payload()

    trainer = quiet_trainer(max_steps=1)
    trainer.fit(Sneaky(), loaders()[0])
    with pytest.raises(TypeError, match=r"checkpoint\['payload'\].*_Payload"):
        trainer.save_checkpoint(tmp_path / "never.ckpt")
    assert not (tmp_path / "never.ckpt").exists()


def test_resuming_from_a_weights_only_checkpoint_is_refused_with_advice(tmp_path):
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(Regressor(), loaders()[0])
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    with pytest.raises(CheckpointError, match="load_from_checkpoint"):
        quiet_trainer(max_steps=2).fit(Regressor(), loaders()[0], ckpt_path=tmp_path / "weights.ckpt")


def test_precision_none_means_the_default_or_the_given_plugin():
    from phalanx.plugins.precision.double import DoublePrecision

    assert quiet_trainer(precision=None).precision == "32-true"
    assert quiet_trainer(precision=None, plugins=[DoublePrecision()]).precision == "64-true"
