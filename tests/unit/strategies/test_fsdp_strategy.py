"""FSDPStrategy, FSDPPrecision and ModelParallelStrategy pieces that need no second process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from phalanx.strategies import STRATEGY_REGISTRY, FSDPStrategy, ModelParallelStrategy
from phalanx.strategies.fsdp._fsdp1_arguments import module_picker
from phalanx.strategies.fsdp.strategy import checkpoint_activations


def test_registry_names_and_trainer_resolution():
    assert STRATEGY_REGISTRY.get_class("fsdp") is FSDPStrategy
    assert STRATEGY_REGISTRY.get("fsdp_cpu_offload").cpu_offload is True
    assert STRATEGY_REGISTRY.get_class("model_parallel") is ModelParallelStrategy
    trainer = phalanx.Trainer(strategy="fsdp", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, FSDPPrecision) and plugin.precision == "bf16-mixed"
    assert (
        trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
        and trainer.strategy.traits.pads_evaluation
    )


def test_fsdp_precision_maps_names_to_a_mixed_precision_policy():
    policy = FSDPPrecision("bf16-mixed").mixed_precision_policy()
    assert policy.param_dtype is torch.bfloat16 and policy.reduce_dtype is torch.float32
    assert FSDPPrecision("32-true").mixed_precision_policy() is None
    assert FSDPPrecision("bf16-true").convert_module(nn.Linear(2, 2)).weight.dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"precision='64-true'.*'32-true'"):
        FSDPPrecision("64-true")


def test_fsdp_needs_an_fsdp_precision_plugin():
    with pytest.raises(TypeError, match="FSDPStrategy runs with FSDPPrecision plugins only, got MixedPrecision"):
        FSDPStrategy(precision_plugin=MixedPrecision("bf16-mixed", device="cpu"))
    strategy = FSDPStrategy()
    with pytest.raises(TypeError, match="FSDPPrecision"):
        strategy.precision_plugin = Precision()
    with pytest.raises(ValueError, match="precision='64-true'"):
        phalanx.Trainer(strategy="fsdp", accelerator="cpu", devices=2, precision="64-true", logger=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "ZERO9"}, ValueError, r"sharding_strategy='ZERO9'.*FULL_SHARD.*HYBRID_SHARD"),
        ({"state_dict_type": "partial"}, ValueError, r"state_dict_type='partial'.*'full', 'sharded'"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload must be a bool"),
        ({"mixed_precision": torch.bfloat16}, TypeError, "MixedPrecisionPolicy"),
        ({"auto_wrap_policy": {int}}, TypeError, "auto_wrap_policy must be a set of nn.Module subclasses"),
        ({"activation_checkpointing_policy": 3}, TypeError, "activation_checkpointing_policy must be"),
        ({"device_mesh": (2, 1)}, ValueError, "device_mesh is for sharding_strategy='HYBRID_SHARD'"),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2,)}, ValueError, "pair"),
        ({"reshard_after_forwrd": True}, TypeError, r"unexpected keyword.*reshard_after_forwrd.*reshard_after_forward"),
    ],
)
def test_bad_options_are_refused_with_the_valid_choices(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_module_pickers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    by_class = module_picker({nn.Linear}, "auto_wrap_policy")
    assert by_class(model) == [model[2][0], model[0]]  # innermost (last registered) first, the root excluded
    by_callable = module_picker(lambda m: sum(p.numel() for p in m.parameters(recurse=False)) > 10, "auto_wrap_policy")
    assert by_callable(model) == [model[0]]
    assert module_picker(None, "auto_wrap_policy") is None


def test_activation_checkpointing_recomputes_forward_in_backward_and_keeps_names():
    calls = []

    class Counted(nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)

    layer = Counted(3, 3)
    names = [name for name, _ in layer.named_parameters()]
    checkpoint_activations(layer)
    checkpoint_activations(layer)  # idempotent
    x = torch.randn(2, 3, requires_grad=True)
    layer(x).sum().backward()
    assert len(calls) == 2 and x.grad is not None
    assert [name for name, _ in layer.named_parameters()] == names
    with torch.no_grad():
        layer(x)
    assert len(calls) == 3  # no recomputation without gradients


class _NoConfigureModel(phalanx.TrainingModule):
    def training_step(self, batch, batch_idx):
        return batch.sum()


@pytest.mark.parametrize(
    "module",
    [_NoConfigureModel(), torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2))],
    ids=["training_module_without_configure_model", "plain_linear", "plain_sequential"],
)
def test_model_parallel_needs_configure_model(module):
    # a plain nn.Module (for example through Cohort.setup) is refused with the same message, not an AttributeError
    name = type(module).__name__
    with pytest.raises(TypeError, match=rf"ModelParallelStrategy needs a TrainingModule whose {name}.configure_model"):
        ModelParallelStrategy().connect(module)


@pytest.mark.parametrize(
    ("dp", "tp", "devices", "num_nodes", "shape"),
    [
        ("auto", "auto", 4, 1, (1, 4)),
        ("auto", "auto", 2, 2, (2, 2)),
        (2, "auto", 4, 1, (2, 2)),
        ("auto", 1, 4, 1, (4, 1)),
        (1, 2, 2, 1, (1, 2)),
    ],
)
def test_model_parallel_mesh_shape(dp, tp, devices, num_nodes, shape):
    strategy = ModelParallelStrategy(
        data_parallel_size=dp, tensor_parallel_size=tp, parallel_devices=[torch.device("cpu")] * devices
    )
    strategy.num_nodes = num_nodes
    assert strategy.mesh_shape() == shape


def test_model_parallel_refuses_sizes_that_do_not_match_the_processes():
    strategy = ModelParallelStrategy(
        data_parallel_size=3, tensor_parallel_size=2, parallel_devices=[torch.device("cpu")] * 4
    )
    with pytest.raises(
        ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 must equal the number of processes \(4"
    ):
        strategy.mesh_shape()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        ModelParallelStrategy(tensor_parallel_size=0)


def test_model_parallel_shards_data_over_the_data_parallel_ranks_only():
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=2, parallel_devices=[torch.device("cpu")] * 4
    )
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0} and strategy.traits.pads_evaluation
