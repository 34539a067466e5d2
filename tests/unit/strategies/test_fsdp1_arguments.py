"""FSDPStrategy takes the seed's (Lightning's) FSDP1 arguments and means by them what FSDP1 meant, on FSDP2."""

from __future__ import annotations

import math
import socket
import warnings
from functools import partial

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.plugins.layer_sync import TorchSyncBatchNorm
from phalanx.strategies import FSDPStrategy
from phalanx.strategies.fsdp import _fsdp1_arguments as seed
from phalanx.strategies.fsdp._fsdp1_arguments import module_picker
from phalanx.utilities.dtensor import is_dtensor


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    # Each seed warning is shown once per process: every test starts as a fresh process would.
    monkeypatch.setattr(seed, "_warned", set())


def _construct(**kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = FSDPStrategy(**kwargs)
    return strategy, [str(w.message) for w in caught]


# ---------------------------------------------------------------------------- sharding strategy, offload, precision
@pytest.mark.parametrize(
    ("sharding_strategy", "name", "reshard_after_forward"),
    [
        ("FULL_SHARD", "FULL_SHARD", True),
        ("full_shard", "FULL_SHARD", True),
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", True),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False),
        ("Shard_Grad_Op", "SHARD_GRAD_OP", False),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", True),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True),
        ("hybrid_shard", "HYBRID_SHARD", True),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "_HYBRID_SHARD_ZERO2", False),
        ("_hybrid_shard_zero2", "_HYBRID_SHARD_ZERO2", False),
    ],
)
def test_sharding_strategy_enum_members_and_strings(sharding_strategy, name, reshard_after_forward):
    strategy, caught = _construct(sharding_strategy=sharding_strategy)
    assert strategy.sharding_strategy == name
    assert strategy.reshard_after_forward is reshard_after_forward
    assert caught == []


def test_explicit_reshard_after_forward_wins_over_the_sharding_strategy():
    assert FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True).reshard_after_forward is True


@pytest.mark.parametrize(
    ("cpu_offload", "expected"),
    [
        (None, False),
        (False, False),
        (True, True),
        (CPUOffload(offload_params=False), False),
        (CPUOffload(offload_params=True), CPUOffloadPolicy),
    ],
)
def test_cpu_offload_forms(cpu_offload, expected):
    strategy, caught = _construct(cpu_offload=cpu_offload)
    if expected is CPUOffloadPolicy:
        assert isinstance(strategy.cpu_offload, CPUOffloadPolicy)
    else:
        assert strategy.cpu_offload is expected
    assert caught == []
    own = CPUOffloadPolicy(pin_memory=False)
    assert FSDPStrategy(cpu_offload=own).cpu_offload is own


def test_the_seeds_default_cpu_offload_none_is_accepted():
    assert FSDPStrategy().cpu_offload is False and FSDPStrategy(cpu_offload=None).cpu_offload is False


@pytest.mark.parametrize(
    ("mixed_precision", "param_dtype", "reduce_dtype", "warning"),
    [
        (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.bfloat16, torch.float32, None),
        (MixedPrecision(param_dtype=torch.float16), torch.float16, None, None),
        (
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            torch.bfloat16,
            torch.bfloat16,
            "FSDP2 does not cast buffers",
        ),
        (
            MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True),
            torch.bfloat16,
            None,
            "keeps the sharded gradients in the parameters' dtype",
        ),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16), torch.bfloat16, None, None),
    ],
)
def test_mixed_precision_becomes_a_mixed_precision_policy(mixed_precision, param_dtype, reduce_dtype, warning):
    strategy, caught = _construct(mixed_precision=mixed_precision)
    policy = strategy.mixed_precision
    assert isinstance(policy, MixedPrecisionPolicy)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)
    if warning is None:
        assert caught == []
    else:
        assert len(caught) == 1 and warning in caught[0]


# ---------------------------------------------------------------------------- FSDP1 keyword arguments
@pytest.mark.parametrize(
    ("kwargs", "warning"),
    [
        ({"use_orig_params": True}, None),
        ({"use_orig_params": False}, "use_orig_params=False): FSDP2 has no flat parameters"),
        ({"limit_all_gathers": True}, None),
        ({"limit_all_gathers": False}, "limit_all_gathers=False): FSDP2 has no all-gather rate limiter"),
        ({"forward_prefetch": False}, None),
        ({"forward_prefetch": True}, "forward_prefetch=True): FSDP2 overlaps the next layer's all-gather implicitly"),
        ({"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}, None),
        (
            {"backward_prefetch": BackwardPrefetch.BACKWARD_POST},
            "backward_prefetch=BACKWARD_POST): FSDP2 always prefetches",
        ),
        ({"backward_prefetch": None}, "backward_prefetch=None): FSDP2 always prefetches"),
        ({"sync_module_states": True}, None),
        ({"sync_module_states": False}, "broadcasts rank 0's initial weights before sharding anyway"),
        ({"param_init_fn": lambda module: None}, "param_init_fn=...): not called"),
        ({"device_id": 0}, "device_id=...): ignored"),
    ],
)
def test_fsdp1_keyword_arguments_are_accepted_and_explained(kwargs, warning):
    strategy, caught = _construct(**kwargs)
    assert strategy._fully_shard_kwargs == {}  # none of them reaches fully_shard
    if warning is None:
        assert caught == []
    else:
        assert len(caught) == 1 and warning in caught[0]


def test_each_explanation_is_shown_once_per_process():
    _, first = _construct(use_orig_params=False, limit_all_gathers=False)
    _, second = _construct(use_orig_params=False, limit_all_gathers=False)
    assert len(first) == 2 and second == []


def test_ignored_modules_become_fully_shards_ignored_params():
    frozen, other = nn.Linear(2, 2), nn.Linear(3, 3)
    strategy = FSDPStrategy(ignored_modules=[frozen], ignored_states=[other.weight])
    assert strategy._fully_shard_kwargs["ignored_params"] == {frozen.weight, frozen.bias, other.weight}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"use_orig_param": True},
            r"unexpected keyword.*'use_orig_param'.*reshard_after_forward.*Lightning's FSDPStrategy: .*use_orig_params",
        ),
        ({"bucket_cap_mb": 25}, r"unexpected keyword.*'bucket_cap_mb'.*Lightning's FSDPStrategy: .*limit_all_gathers"),
    ],
)
def test_a_name_neither_fully_shard_nor_fsdp1_knows_is_refused_with_the_valid_names(kwargs, match):
    with pytest.raises(TypeError, match=match):
        FSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": 3}, ValueError, r"sharding_strategy=3.*_HYBRID_SHARD_ZERO2.*ShardingStrategy member"),
        (
            {"cpu_offload": "yes"},
            TypeError,
            "cpu_offload must be a bool, None, a torch.distributed.fsdp.CPUOffloadPolicy or an FSDP1 CPUOffload",
        ),
        (
            {"mixed_precision": "bf16"},
            TypeError,
            "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or an FSDP1 MixedPrecision",
        ),
        (
            {"auto_wrap_policy": lambda module, recurse: True},
            TypeError,
            r"auto_wrap_policy=.* can be called neither as \(module\) nor as \(module, recurse, nonwrapped_numel\)",
        ),
        (
            {"activation_checkpointing_policy": lambda a, b: True},
            TypeError,
            r"activation_checkpointing_policy=.* can be called neither",
        ),
        (
            {"activation_checkpointing": nn.Linear, "activation_checkpointing_policy": {nn.Linear}},
            ValueError,
            "Pass activation_checkpointing_policy= only",
        ),
        (
            {"activation_checkpointing": "Linear"},
            TypeError,
            "activation_checkpointing must be an nn.Module subclass or a list",
        ),
        ({"process_group": object()}, ValueError, "process_group must be one ProcessGroup"),
        (
            {"sharding_strategy": "HYBRID_SHARD", "process_group": object()},
            ValueError,
            r"process_group=\(shard_group, replicate_group\)",
        ),
        ({"device_mesh": 4}, TypeError, r"device_mesh must be a tuple \(replicas, shard size\)"),
        ({"device_mesh": (0,)}, ValueError, r"device_mesh=\(0,\) must be \(processes,\)"),
    ],
)
def test_bad_seed_argument_values_name_the_valid_forms(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_a_one_dimensional_device_mesh_is_accepted_without_hybrid_sharding():
    assert FSDPStrategy(device_mesh=(2,))._device_mesh_spec == (2,)
    assert FSDPStrategy(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=(2, 4))._device_mesh_spec == (2, 4)


# ---------------------------------------------------------------------------- wrap and checkpointing policies
class Block(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.inner(x)))


class Net(phalanx.TrainingModule):
    def __init__(self, batchnorm: bool = False, wrap_in_configure_model: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.big = nn.Linear(6, 40)
        self.out = nn.Linear(40, 1)
        self.norm = nn.BatchNorm1d(1) if batchnorm else None
        self.wrap_in_configure_model = wrap_in_configure_model

    def configure_model(self):
        if self.wrap_in_configure_model and not hasattr(self, "head"):
            from torch.distributed.fsdp.wrap import wrap

            self.head = wrap(nn.Linear(1, 1))  # FSDP1's manual wrapping, as Lightning's FSDP documentation shows it

    def forward(self, x):
        output = self.out(torch.relu(self.big(self.blocks(self.inp(x)))))
        if hasattr(self, "head"):
            output = self.head(output)
        if self.norm is not None and not self.training:
            output = self.norm(
                output
            )  # evaluation mode only: then SyncBatchNorm runs without a collective, also on the CPU
        return output

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self(batch[0]).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _user_policy(module, recurse, nonwrapped_numel):  # a policy a user wrote for FSDP1
    return recurse or isinstance(module, Block)


def _old_style_policy(module, recurse, unwrapped_params):  # FSDP1's older name for the third argument
    return recurse or unwrapped_params >= 200


FSDP1_POLICIES = {
    "ModuleWrapPolicy": ModuleWrapPolicy({Block}),
    "transformer_auto_wrap_policy": partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "size_based_auto_wrap_policy": partial(size_based_auto_wrap_policy, min_num_params=40),
    "user (module, recurse, nonwrapped_numel)": _user_policy,
    "user (module, recurse, unwrapped_params)": _old_style_policy,
}


def _fsdp1_choice(policy, root):
    # What FSDP1's own auto wrapping wraps, the root excluded (a recording "wrapper" that wraps nothing).
    chosen = []
    by_keyword = lambda module, recurse, nonwrapped_numel: policy(module, recurse, nonwrapped_numel)  # noqa: E731 - how torch calls it
    _recursive_wrap(
        root,
        by_keyword,
        wrapper_cls=lambda module, **kwargs: chosen.append(module) or module,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return chosen


@pytest.mark.parametrize("name", list(FSDP1_POLICIES))
def test_fsdp1_policies_pick_what_fsdp1_would_wrap(name):
    policy, model = FSDP1_POLICIES[name], Net()
    picked = module_picker(policy, "auto_wrap_policy")(model)
    assert picked and {id(m) for m in picked} == {id(m) for m in _fsdp1_choice(policy, model)}
    for i, outer in enumerate(picked):  # inner layers come before the blocks that contain them
        assert not any(inner is later for inner in outer.modules() for later in picked[i + 1 :])


@pytest.mark.parametrize(
    "policy",
    [
        {Block},
        [Block],
        (Block,),
        Block,
        lambda module: isinstance(module, Block),
        CustomPolicy(lambda module: isinstance(module, Block)),
        ModuleWrapPolicy([Block]),
    ],
)
def test_every_policy_form_selects_the_blocks(policy):
    model = Net()
    assert module_picker(policy, "activation_checkpointing_policy")(model) == [model.blocks[1], model.blocks[0]]


# ---------------------------------------------------------------------------- the seed's arguments in a real
# (one-process) run
@pytest.fixture
def one_process_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fit(module, strategy, **trainer_kwargs):
    trainer = phalanx.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer.fit(module, data, data)
    return trainer


def test_a_lightning_fsdp1_configuration_shards_the_chosen_layers_first_then_places_them(
    one_process_group, monkeypatch
):
    import torch.distributed.fsdp as fsdp

    events = []
    real_fully_shard, real_to_device = fsdp.fully_shard, FSDPStrategy.model_to_device
    monkeypatch.setattr(
        fsdp,
        "fully_shard",
        lambda module, **kwargs: events.append(("shard", type(module).__name__)) or real_fully_shard(module, **kwargs),
    )
    monkeypatch.setattr(
        FSDPStrategy, "model_to_device", lambda self: events.append(("to_device", None)) or real_to_device(self)
    )
    module = Net(wrap_in_configure_model=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = FSDPStrategy(
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            activation_checkpointing=[Block],
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            cpu_offload=None,
            process_group=torch.distributed.group.WORLD,
            use_orig_params=True,
            limit_all_gathers=True,
            sync_module_states=True,
        )
        trainer = _fit(module, strategy)
    assert trainer.global_step == 2
    assert [
        isinstance(m, FSDPModule)
        for m in (module, module.blocks[0], module.blocks[1], module.head, module.inp, module.blocks[0].inner)
    ] == [True] * 4 + [False] * 2
    assert all("_phalanx_checkpointed_forward" in block.__dict__ for block in module.blocks)
    assert [str(w.message) for w in caught if "FSDPStrategy(" in str(w.message)] == [
        "FSDPStrategy(activation_checkpointing=...) is deprecated; pass activation_checkpointing_policy={Block}"
        " instead."
    ]  # the other seed arguments ask for what FSDP2 does: nothing to explain
    assert events == [
        ("shard", "Block"),
        ("shard", "Block"),
        ("shard", "Linear"),
        ("shard", "Net"),
        ("to_device", None),
    ]  # never moved before sharding
    assert strategy.device_mesh.ndim == 1


def test_sync_batchnorm_layers_are_converted_before_sharding_and_stay_usable(one_process_group):
    module = Net(batchnorm=True)
    trainer = _fit(module, FSDPStrategy(), plugins=[TorchSyncBatchNorm()], limit_val_batches=1)
    assert isinstance(module.norm, nn.SyncBatchNorm) and is_dtensor(module.norm.weight)  # sharded like any other layer
    # After fit (teardown done) the module is still the one fully_shard manages: evaluation runs through it.
    validated = trainer.validate(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4), verbose=False)
    assert math.isfinite(validated[0]["val"]) and isinstance(module.norm, nn.SyncBatchNorm)


def test_configure_model_layers_are_created_in_host_memory_not_on_the_device():
    strategy = FSDPStrategy(parallel_devices=[torch.device("cuda", 0)])  # no GPU needed: nothing may be created there
    with strategy.tensor_init_context():
        layer = nn.Linear(2, 2)
    with strategy.tensor_init_context(empty_init=True):
        deferred = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and deferred.weight.is_meta


@pytest.mark.parametrize(
    ("kwargs", "shape"),
    [
        ({}, (1,)),
        ({"sharding_strategy": "NO_SHARD"}, (1, 1)),
        ({"sharding_strategy": "HYBRID_SHARD"}, (1, 1)),
        ({"device_mesh": (1,)}, (1,)),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": (1, 1)}, (1, 1)),
        ({"process_group": "world"}, (1,)),
        ({"sharding_strategy": ShardingStrategy.NO_SHARD, "process_group": "world"}, (1, 1)),
        ({"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "process_group": ("world", "world")}, (1, 1)),
    ],
)
def test_process_group_and_device_mesh_forms_become_the_mesh(one_process_group, kwargs, shape):
    world = torch.distributed.group.WORLD
    kwargs = {
        name: (world, world) if value == ("world", "world") else world if value == "world" else value
        for name, value in kwargs.items()
    }
    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")], **kwargs)
    assert tuple(strategy._build_mesh().shape) == shape


def test_mesh_sizes_that_do_not_match_the_job_are_refused(one_process_group):
    with pytest.raises(ValueError, match=r"device_mesh=\(2,\) has 2 processes, but the job has 1"):
        FSDPStrategy(parallel_devices=[torch.device("cpu")], device_mesh=(2,))._build_mesh()
    with pytest.raises(ValueError, match="pass only one of them"):
        FSDPStrategy(process_group=torch.distributed.group.WORLD, device_mesh=(1,))
