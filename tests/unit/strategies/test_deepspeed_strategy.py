"""DeepSpeedStrategy pieces that need no DeepSpeed engine (and no deepspeed installation)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
import phalanx.strategies.deepspeed.strategy as deepspeed_module
from phalanx.optimization import init_optimizers_and_schedulers
from phalanx.plugins.precision import DeepSpeedPrecision, HalfPrecision, MixedPrecision
from phalanx.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy, RunSettings
from phalanx.strategies.deepspeed.strategy import CONFIG_ENV_VAR, DeepSpeedOptimizerHandle
from phalanx.trainer.loops.data import DataSource
from phalanx.trainer.loops.evaluation_loop import check_equal_batches
from phalanx.trainer.run_settings import train_batch_size

NAMES = {
    "deepspeed": {},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    "deepspeed_stage_3_offload_nvme": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
        "remote_device": "nvme",
        "offload_params_device": "nvme",
        "offload_optimizer_device": "nvme",
    },
}


@pytest.fixture(autouse=True)
def _deepspeed_installed(monkeypatch):
    # Building the strategy only checks that deepspeed can be imported; these tests never import it.
    monkeypatch.setattr(deepspeed_module, "deepspeed_available", lambda: True)
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


def _settings(accumulate=1, clip=None, algorithm="norm", batch_size=None, stage="fit"):
    return RunSettings(
        stage=stage,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        train_batch_size=batch_size,
    )


# ---------------------------------------------------------------------------- selection
def test_registry_names_and_their_options():
    for name, options in NAMES.items():
        assert STRATEGY_REGISTRY.get_class(name) is DeepSpeedStrategy
        assert STRATEGY_REGISTRY.init_params(name) == options
        assert "DeepSpeed" in STRATEGY_REGISTRY.description(name)
    assert STRATEGY_REGISTRY.get("deepspeed").zero_stage == 2  # Lightning's default
    nvme = STRATEGY_REGISTRY.get("deepspeed_stage_3_offload_nvme").config["zero_optimization"]
    assert nvme["offload_param"]["device"] == nvme["offload_optimizer"]["device"] == "nvme"


def test_without_deepspeed_selecting_it_says_how_to_install(monkeypatch):
    monkeypatch.setattr(deepspeed_module, "deepspeed_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'phalanx\[deepspeed\]'"):
        phalanx.Trainer(strategy="deepspeed_stage_3", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'phalanx\[deepspeed\]'"):
        DeepSpeedStrategy(stage=1)
    assert "deepspeed_stage_2" in STRATEGY_REGISTRY.available()  # still listed


def test_importing_phalanx_does_not_import_deepspeed():
    code = (
        "import sys, phalanx, phalanx.strategies, phalanx.plugins.precision; phalanx.Trainer; print('deepspeed' in"
        " sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_trainer_resolves_deepspeed_with_its_precision_plugin():
    trainer = phalanx.Trainer(
        strategy="deepspeed_stage_3", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False
    )
    strategy = trainer.strategy
    assert isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage == 3
    assert (
        isinstance(strategy.precision_plugin, DeepSpeedPrecision)
        and strategy.precision_plugin.precision == "bf16-mixed"
    )
    assert (
        strategy.traits.handles_gradient_accumulation
        and strategy.traits.restore_checkpoint_after_setup
        and not strategy.traits.restores_optimizer
    )
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0} and strategy.traits.pads_evaluation
    stage2 = phalanx.Trainer(strategy="deepspeed", accelerator="cpu", devices=2, logger=False).strategy
    assert (
        stage2.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0} and not stage2.traits.pads_evaluation
    )  # only ZeRO-3 needs equal evaluation batches
    assert isinstance(stage2.precision_plugin, DeepSpeedPrecision) and stage2.precision_plugin.precision == "32-true"


def test_precision_plugins_that_are_not_deepspeeds_are_refused():
    with pytest.raises(TypeError, match="runs with DeepSpeedPrecision plugins only, got MixedPrecision"):
        phalanx.Trainer(
            strategy="deepspeed",
            accelerator="cpu",
            devices=2,
            plugins=[MixedPrecision("bf16-mixed", device="cpu")],
            logger=False,
        )
    with pytest.raises(TypeError, match="DeepSpeedPrecision"):
        DeepSpeedStrategy(precision_plugin=HalfPrecision("bf16-true"))
    with pytest.raises(
        ValueError, match=r"'64-true' is not available with DeepSpeed; choose one of \['32-true', '16-mixed'"
    ):
        phalanx.Trainer(strategy="deepspeed", accelerator="cpu", devices=2, precision="64-true", logger=False)
    strategy = DeepSpeedStrategy(precision_plugin=DeepSpeedPrecision("16-true"))
    trainer = phalanx.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.precision_plugin.precision == "16-true"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, r"stage=4 is not a ZeRO stage; choose 0, 1, 2 or 3"),
        ({"stage": True}, r"not a ZeRO stage"),
        ({"stage": 2, "offload_parameters": True}, r"offload_parameters=True needs ZeRO stage 3"),
        ({"stage": 0, "offload_optimizer": True}, r"offload_optimizer=True needs ZeRO stage 1, 2 or 3"),
        (
            {"offload_optimizer_device": "gpu"},
            r"offload_optimizer_device='gpu' is not valid; choose one of \['cpu', 'nvme'\]",
        ),
        (
            {"stage": 3, "remote_device": "disk"},
            r"remote_device='disk' is not valid; choose one of \[None, 'cpu', 'nvme'\]",
        ),
        ({"stage": 2, "remote_device": "cpu"}, r"applies to ZeRO stage 3 only"),
        ({"stage": 3, "remote_device": "nvme", "nvme_path": ""}, r"needs nvme_path="),
        ({"logging_batch_size_per_gpu": 0}, r"'auto' or an int >= 1"),
        ({"start_method": "thread"}, r"start_method='thread' is not valid"),
    ],
)
def test_bad_options_are_refused_with_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedStrategy(**kwargs)


# ---------------------------------------------------------------------------- configuration
def test_generated_config_follows_the_options():
    config = DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        allgather_bucket_size=5,
        reduce_bucket_size=7,
        overlap_comm=False,
        contiguous_gradients=False,
        pin_memory=True,
        param_persistence_threshold=11,
    ).config
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["allgather_bucket_size"] == 5 and zero["reduce_bucket_size"] == 7
    assert (
        zero["overlap_comm"] is False
        and zero["contiguous_gradients"] is False
        and zero["stage3_param_persistence_threshold"] == 11
    )
    assert zero["offload_optimizer"] == {
        "device": "cpu",
        "nvme_path": "/local_nvme",
        "buffer_count": 4,
        "pin_memory": True,
    }
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_param"]["buffer_size"] == 100_000_000
    assert config["zero_allow_untested_optimizer"] is True
    assert DeepSpeedStrategy(stage=0).config["zero_optimization"] == {"stage": 0}
    assert "offload_optimizer" not in DeepSpeedStrategy(stage=2).config["zero_optimization"]


def test_config_takes_batch_size_accumulation_clipping_and_precision_from_the_run_settings():
    loader = DataLoader(TensorDataset(torch.zeros(40, 2)), batch_size=5)
    strategy = DeepSpeedStrategy(stage=2, precision_plugin=DeepSpeedPrecision("bf16-mixed"))
    assert (
        strategy.traits.needs_train_batch_size
        and not DeepSpeedStrategy(logging_batch_size_per_gpu=3).traits.needs_train_batch_size
    )
    batch_size = train_batch_size(DataSource(phalanx.TrainingModule(), None, train=loader))  # what the Trainer passes
    config = strategy._build_config(_settings(accumulate=4, clip=0.25, batch_size=batch_size))
    assert config["train_micro_batch_size_per_gpu"] == 5
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.25
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    plain = DeepSpeedStrategy(stage=1, logging_batch_size_per_gpu=3)._build_config(_settings(batch_size=7))
    assert plain["train_micro_batch_size_per_gpu"] == 3
    assert plain["gradient_clipping"] == 0.0  # DeepSpeed's own default (1.0) would clip without being asked
    fp16 = DeepSpeedStrategy(loss_scale=128.0, precision_plugin=DeepSpeedPrecision("16-mixed"))._build_config(
        _settings(stage="validate")
    )
    assert (
        fp16["fp16"]["enabled"] is True
        and fp16["fp16"]["loss_scale"] == 128.0
        and fp16["fp16"]["initial_scale_power"] == 16
    )
    assert fp16["train_micro_batch_size_per_gpu"] == 1  # evaluation does not look at the training data


def test_config_conflicts_with_the_trainer_are_refused():
    with pytest.raises(ValueError, match="clips gradients by norm only"):
        DeepSpeedStrategy()._build_config(_settings(clip=1.0, algorithm="value", stage="test"))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=8 but the Trainer has accumulate_grad_batches=2"):
        DeepSpeedStrategy(config={"gradient_accumulation_steps": 8})._build_config(
            _settings(accumulate=2, stage="test")
        )
    with pytest.raises(ValueError, match="gradient_clipping=2.0 but the Trainer has gradient_clip_val=1.0"):
        DeepSpeedStrategy(config={"gradient_clipping": 2.0})._build_config(_settings(clip=1.0, stage="test"))
    with pytest.raises(ValueError, match=r"enables 'fp16' but the precision is '32-true'"):
        DeepSpeedStrategy(config={"fp16": {"enabled": True}})._build_config(_settings(stage="test"))
    with pytest.raises(ValueError, match=r"disables 'bf16' but the precision is 'bf16-true'"):
        DeepSpeedStrategy(
            config={"bf16": {"enabled": False}}, precision_plugin=DeepSpeedPrecision("bf16-true")
        )._build_config(_settings(stage="test"))


def test_a_full_config_from_a_dict_a_file_or_the_environment_replaces_the_generated_one(tmp_path, monkeypatch):
    given = {
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10},
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
    }
    from_dict = DeepSpeedStrategy(stage=1, config=given)
    given["zero_optimization"]["stage"] = 0  # the strategy keeps its own copy
    assert from_dict.zero_stage == 3
    config = from_dict._build_config(_settings())
    assert config["zero_optimization"] == {"stage": 3, "stage3_max_live_parameters": 10}
    assert (
        config["train_micro_batch_size_per_gpu"] == 2
        and config["gradient_clipping"] == 0.5
        and config["gradient_accumulation_steps"] == 1
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert DeepSpeedStrategy(config=path).zero_stage == 1
    assert DeepSpeedStrategy(config=str(path)).config["zero_optimization"] == {"stage": 1}
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert DeepSpeedStrategy(stage=3).zero_stage == 1  # the environment's file wins over the arguments
    assert (
        DeepSpeedStrategy(stage=3, config={"zero_optimization": {"stage": 2}}).zero_stage == 2
    )  # an explicit config wins


def test_bad_configs_are_refused(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="config does not exist"):
        DeepSpeedStrategy(config=tmp_path / "missing.json")
    monkeypatch.setenv(CONFIG_ENV_VAR, str(tmp_path / "also_missing.json"))
    with pytest.raises(FileNotFoundError, match=CONFIG_ENV_VAR):
        DeepSpeedStrategy()
    monkeypatch.delenv(CONFIG_ENV_VAR)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        DeepSpeedStrategy(config=broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        DeepSpeedStrategy(config=listed)
    with pytest.raises(TypeError, match="config must be a dict or the path"):
        DeepSpeedStrategy(config=3)


# ---------------------------------------------------------------------------- pieces of the run
def test_optimizer_handle_leaves_gradients_to_the_engine():
    parameter = nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 2.0)
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    handle = DeepSpeedOptimizerHandle(optimizer)
    handle.zero_grad(set_to_none=True)
    assert torch.equal(parameter.grad, torch.full((3,), 2.0))  # kept: accumulated gradients belong to the engine
    assert handle.param_groups is optimizer.param_groups and handle.state_dict() == optimizer.state_dict()
    with pytest.raises(RuntimeError, match="the engine steps the optimizer"):
        handle.step()


class _BoundaryEngine:
    """Records the accumulation boundary the strategy sets before each engine step."""

    def __init__(self) -> None:
        self.boundaries: list[bool] = []
        self.flag: bool | None = None  # what the engine would use: the last flag set

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def set_gradient_accumulation_boundary(self, flag: bool) -> None:
        self.flag = flag

    def step(self) -> None:
        self.boundaries.append(self.flag)


@pytest.mark.parametrize(
    ("accumulate", "blocked", "expected"),
    [
        (
            3,
            [True, True, False, True, True, False, False],
            [False, False, True, False, False, True, True],
        ),  # the loop's windows
        (1, [False, False], [True, True]),
        (1, [True, False], [False, True]),  # the flag set inside the context does not stay after it
    ],
)
def test_steps_inside_block_backward_sync_do_not_end_the_accumulation_window(accumulate, blocked, expected):
    strategy = DeepSpeedStrategy()
    engine = _BoundaryEngine()
    strategy._engine, strategy._engine_trains, strategy._module = engine, True, nn.Linear(1, 1)
    strategy._accumulation = accumulate
    for inside in blocked:
        with strategy.block_backward_sync() if inside else nullcontext():
            strategy.optimizer_step(object(), lambda: torch.ones(()))
    assert engine.boundaries == expected
    assert strategy._window_open is False  # the context is left closed, also after it ends


def test_zero3_refuses_evaluation_that_would_leave_a_rank_waiting(monkeypatch):
    strategy = DeepSpeedStrategy(stage=3)
    module = nn.Linear(2, 2)
    module.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    strategy._module = module
    monkeypatch.setattr(DeepSpeedStrategy, "world_size", property(lambda self: 2))
    strategy.all_gather_object = lambda mine: [mine, [4.0]]
    assert strategy.traits.requires_equal_batches
    check_equal_batches(strategy, [4], "validation")  # equal: fine
    with pytest.raises(
        ValueError,
        match=r"same number of validation batches; they differ \(rank 0: \[5\], rank 1: \[4\]\).*limit_val_batches",
    ):
        check_equal_batches(strategy, [5], "validation")
    del module.weight.ds_id
    assert not strategy.traits.requires_equal_batches
    check_equal_batches(strategy, [5], "validation")  # nothing partitioned: no collective in the forward pass


def test_checkpoints_need_the_training_engine(tmp_path):
    strategy = DeepSpeedStrategy()
    with pytest.raises(RuntimeError, match="exists during and after fit"):
        strategy.save_checkpoint({"epoch": 0}, tmp_path / "x.ckpt")
    with pytest.raises(RuntimeError, match="exists during and after fit"):
        strategy.backward(torch.ones(()), None)
    assert strategy.optimizer_state(object()) == {"stored_by": "deepspeed"}


class _TwoOptimizers(phalanx.TrainingModule):
    def __init__(self, schedule: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.schedule = schedule

    def configure_optimizers(self):
        first = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.schedule:
            return {"optimizer": first, "lr_scheduler": torch.optim.lr_scheduler.StepLR(first, 1)}
        return [first, torch.optim.SGD(self.parameters(), lr=0.1)]


def test_optimizer_configurations_deepspeed_cannot_drive_are_refused(monkeypatch):
    monkeypatch.setattr(
        deepspeed_module, "_import_deepspeed", lambda: pytest.fail("refused before DeepSpeed is needed")
    )
    strategy = DeepSpeedStrategy()
    settings = RunSettings(configure_optimizers=init_optimizers_and_schedulers)
    strategy._module = _TwoOptimizers()
    with pytest.raises(ValueError, match="DeepSpeed drives exactly one optimizer, but configure_optimizers returned 2"):
        strategy._initialize_training_engine({"zero_optimization": {"stage": 2}}, settings)
    strategy._module = _TwoOptimizers(schedule=True)
    with pytest.raises(ValueError, match="Both configure_optimizers and the DeepSpeed config define an LR scheduler"):
        strategy._initialize_training_engine({"scheduler": {"type": "WarmupLR"}}, settings)
    with pytest.raises(
        ValueError,
        match=r"needs configure_optimizers= in the settings, or an 'optimizer' section in the DeepSpeed config",
    ):
        strategy._initialize_training_engine({}, RunSettings())
