"""DeepSpeedStrategy's keyword arguments: each one reaches the DeepSpeed config under its DeepSpeed name, and bad ones
are refused with the exact message (and in the order) they always were. No deepspeed import, no engine."""

from __future__ import annotations

import pytest

import phalanx.strategies.deepspeed.strategy as deepspeed_module
from phalanx.plugins.precision import DeepSpeedPrecision
from phalanx.strategies import DeepSpeedStrategy, RunSettings
from phalanx.strategies.deepspeed._config import CONFIG_ENV_VAR


@pytest.fixture(autouse=True)
def _deepspeed_installed(monkeypatch):
    # Building the strategy only checks that deepspeed can be imported; these tests never import it.
    monkeypatch.setattr(deepspeed_module, "deepspeed_available", lambda: True)
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


# Stage 3 with both offloads on: the configuration in which every ZeRO argument appears in the config.
_EVERYTHING_ON = {"stage": 3, "offload_optimizer": True, "offload_parameters": True}

# (argument, a value other than its default, where the config holds it)
ARGUMENTS = [
    ("offload_params_device", "nvme", ("zero_optimization", "offload_param", "device")),
    ("offload_optimizer_device", "nvme", ("zero_optimization", "offload_optimizer", "device")),
    ("nvme_path", "/scratch/nvme", ("zero_optimization", "offload_param", "nvme_path")),
    ("nvme_path", "/scratch/nvme", ("zero_optimization", "offload_optimizer", "nvme_path")),
    ("params_buffer_count", 9, ("zero_optimization", "offload_param", "buffer_count")),
    ("params_buffer_size", 12_345, ("zero_optimization", "offload_param", "buffer_size")),
    ("max_in_cpu", 54_321, ("zero_optimization", "offload_param", "max_in_cpu")),
    ("pin_memory", True, ("zero_optimization", "offload_param", "pin_memory")),
    ("pin_memory", True, ("zero_optimization", "offload_optimizer", "pin_memory")),
    ("optimizer_buffer_count", 7, ("zero_optimization", "offload_optimizer", "buffer_count")),
    ("sub_group_size", 4_096, ("zero_optimization", "sub_group_size")),
    ("param_persistence_threshold", 77, ("zero_optimization", "stage3_param_persistence_threshold")),
    ("contiguous_gradients", False, ("zero_optimization", "contiguous_gradients")),
    ("overlap_comm", False, ("zero_optimization", "overlap_comm")),
    ("allgather_partitions", False, ("zero_optimization", "allgather_partitions")),
    ("reduce_scatter", False, ("zero_optimization", "reduce_scatter")),
    ("allgather_bucket_size", 1_000, ("zero_optimization", "allgather_bucket_size")),
    ("reduce_bucket_size", 2_000, ("zero_optimization", "reduce_bucket_size")),
    ("zero_allow_untested_optimizer", False, ("zero_allow_untested_optimizer",)),
    ("partition_activations", True, ("activation_checkpointing", "partition_activations")),
    ("cpu_checkpointing", True, ("activation_checkpointing", "cpu_checkpointing")),
    ("synchronize_checkpoint_boundary", True, ("activation_checkpointing", "synchronize_checkpoint_boundary")),
    ("loss_scale", 128.0, ("fp16", "loss_scale")),
    ("initial_scale_power", 8, ("fp16", "initial_scale_power")),
    ("loss_scale_window", 50, ("fp16", "loss_scale_window")),
    ("hysteresis", 5, ("fp16", "hysteresis")),
    ("min_loss_scale", 3, ("fp16", "min_loss_scale")),
    ("logging_batch_size_per_gpu", 6, ("train_micro_batch_size_per_gpu",)),
]


_MISSING = object()


def _lookup(config: dict, path: tuple[str, ...]):
    for key in path:
        if key not in config:
            return _MISSING
        config = config[key]
    return config


@pytest.mark.parametrize(
    ("argument", "value", "path"), ARGUMENTS, ids=[f"{row[0]}->{'.'.join(row[2])}" for row in ARGUMENTS]
)
def test_each_argument_reaches_the_config_under_its_deepspeed_name(argument, value, path):
    settings = RunSettings(stage="fit", train_batch_size=2)
    precision = DeepSpeedPrecision("16-mixed")  # so that the fp16 section (loss scaling) is written
    default = DeepSpeedStrategy(**_EVERYTHING_ON, precision_plugin=precision)._build_config(settings)
    strategy = DeepSpeedStrategy(**_EVERYTHING_ON, **{argument: value}, precision_plugin=precision)
    config = strategy._build_config(settings)
    assert _lookup(config, path) == value
    assert _lookup(default, path) != value  # the value is not the default: the argument, not chance, put it there


# (arguments, exception type, the whole message): several bad arguments at once pin the order of the checks.
REFUSED = [
    ({"stage": 4}, ValueError, "stage=4 is not a ZeRO stage; choose 0, 1, 2 or 3."),
    ({"stage": True}, ValueError, "stage=True is not a ZeRO stage; choose 0, 1, 2 or 3."),
    ({"stage": "2"}, ValueError, "stage='2' is not a ZeRO stage; choose 0, 1, 2 or 3."),
    (
        {"offload_params_device": "gpu"},
        ValueError,
        "offload_params_device='gpu' is not valid; choose one of ['cpu', 'nvme'].",
    ),
    (
        {"offload_optimizer_device": "disk"},
        ValueError,
        "offload_optimizer_device='disk' is not valid; choose one of ['cpu', 'nvme'].",
    ),
    (
        {"stage": 3, "remote_device": "gpu"},
        ValueError,
        "remote_device='gpu' is not valid; choose one of [None, 'cpu', 'nvme'].",
    ),
    (
        {"stage": 0, "offload_optimizer": True},
        ValueError,
        "offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage=0 does not partition the optimizer).",
    ),
    (
        {"stage": 2, "offload_parameters": True},
        ValueError,
        "offload_parameters=True needs ZeRO stage 3 (only stage 3 partitions parameters); got stage=2.",
    ),
    (
        {"stage": 2, "remote_device": "cpu"},
        ValueError,
        "remote_device='cpu' applies to ZeRO stage 3 only; got stage=2.",
    ),
    *[
        (kwargs, ValueError, "Offloading to 'nvme' needs nvme_path= (a directory on a fast local NVMe drive).")
        for kwargs in (
            {"stage": 3, "remote_device": "nvme", "nvme_path": ""},
            {"stage": 3, "offload_parameters": True, "offload_params_device": "nvme", "nvme_path": ""},
            {"stage": 1, "offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": ""},
        )
    ],
    *[
        (
            {"logging_batch_size_per_gpu": value},
            ValueError,
            f"logging_batch_size_per_gpu={value!r} must be 'auto' or an int >= 1.",
        )
        for value in (0, True, "8")
    ],
    *[
        (
            {"allow_unsafe_checkpoint_load": value},
            TypeError,
            f"allow_unsafe_checkpoint_load must be True or False, got {value!r}.",
        )
        for value in ("yes", 1)
    ],
    ({"partition_activations": "yes"}, TypeError, "partition_activations='yes' is not valid; pass True or False."),
    ({"config": 5}, TypeError, "config must be a dict or the path of a DeepSpeed JSON file, got int."),
    (
        {"config": {"activation_checkpointing": {"partition_activations": False}}, "partition_activations": True},
        ValueError,
        "DeepSpeedStrategy(partition_activations=True) conflicts with the config's"
        " activation_checkpointing['partition_activations']=False; set it in one place (the explicit config wins when"
        " the argument is left at its default).",
    ),
    # Several bad arguments: the first check in the order above decides the message.
    ({"stage": 5, "offload_params_device": "gpu"}, ValueError, "stage=5 is not a ZeRO stage; choose 0, 1, 2 or 3."),
    (
        {"offload_params_device": "gpu", "offload_optimizer_device": "gpu"},
        ValueError,
        "offload_params_device='gpu' is not valid; choose one of ['cpu', 'nvme'].",
    ),
    (
        {"stage": 0, "offload_optimizer": True, "offload_parameters": True},
        ValueError,
        "offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage=0 does not partition the optimizer).",
    ),
    (
        {"remote_device": "cpu", "logging_batch_size_per_gpu": 0},
        ValueError,
        "remote_device='cpu' applies to ZeRO stage 3 only; got stage=2.",
    ),
    (
        {"logging_batch_size_per_gpu": 0, "config": 5},
        ValueError,
        "logging_batch_size_per_gpu=0 must be 'auto' or an int >= 1.",
    ),
    (
        {"config": 5, "partition_activations": "yes"},
        TypeError,
        "config must be a dict or the path of a DeepSpeed JSON file, got int.",
    ),
    (
        {"partition_activations": "yes", "allow_unsafe_checkpoint_load": "yes"},
        TypeError,
        "partition_activations='yes' is not valid; pass True or False.",
    ),
    (
        {"contiguous_memory_optimization": True, "allow_unsafe_checkpoint_load": "yes"},
        ValueError,
        "contiguous_memory_optimization=True needs partition_activations=True (DeepSpeed copies partitioned"
        " activations only).",
    ),
    (
        {"start_method": "thread", "stage": 4},
        ValueError,
        "start_method='thread' is not valid; choose one of ('popen', 'spawn', 'fork', 'forkserver').",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), REFUSED, ids=[repr(row[0]) for row in REFUSED])
def test_bad_arguments_are_refused_with_the_whole_message_in_a_fixed_order(kwargs, error, message):
    with pytest.raises(error) as raised:
        DeepSpeedStrategy(**kwargs)
    assert type(raised.value) is error and str(raised.value) == message
