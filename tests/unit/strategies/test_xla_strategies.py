"""XLA strategies without torch_xla: bad arguments, registry names, the launcher's variables, per-thread ranks.

What needs the runtime (training, collectives, checkpoints) is in tests/xla, run in a virtual environment with
torch_xla.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx.accelerators import XLAAccelerator
from phalanx.plugins.environments.xla import XLAEnvironment
from phalanx.plugins.precision import MixedPrecision, XLAPrecision
from phalanx.strategies import (
    STRATEGY_REGISTRY,
    SingleDeviceXLAStrategy,
    XLAFSDPStrategy,
    XLASPMDStrategy,
    XLAStrategy,
)
from phalanx.strategies.xla._collectives import _padded_length
from phalanx.strategies.xla._common import DeviceLoader, holds_xla_tensors, to_cpu
from phalanx.strategies.xla.launcher import XLALauncher, _variables
from phalanx.strategies.xla.spmd import partition_spec
from phalanx.utilities import rank_zero
from phalanx.utilities.rank_zero import rank_zero_only, use_thread_rank


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: XLAStrategy(sync_module_states="yes"), TypeError, r"sync_module_states='yes'\) must be True or False"),
        (lambda: XLAStrategy(debug=1), TypeError, r"debug=1\) must be True or False"),
        (lambda: XLAStrategy(start_method="forkserver"), ValueError, r"choose one of \['spawn', 'fork'\]"),
        (lambda: XLAStrategy(parallel_devices=[torch.device("cpu")]), ValueError, r"runs on XLA devices, got cpu"),
        (lambda: XLAStrategy(precision_plugin=MixedPrecision("bf16-mixed", device="cpu")), TypeError, "XLAPrecision"),
        (lambda: SingleDeviceXLAStrategy(device="cpu"), ValueError, r"runs on XLA devices, got device='cpu'"),
        (lambda: SingleDeviceXLAStrategy(device="cuda:0"), ValueError, r"runs on XLA devices"),
        (lambda: SingleDeviceXLAStrategy(device="nonsense"), ValueError, r"not a torch device"),
        (lambda: SingleDeviceXLAStrategy(precision_plugin=MixedPrecision()), TypeError, "XLAPrecision plugins only"),
        (lambda: XLAPrecision("16-mixed"), ValueError, r"not supported on XLA devices; choose one of \['32-true'"),
        (lambda: XLAPrecision("64-true"), ValueError, r"'bf16-true', 'bf16-mixed'\]"),
        (lambda: XLALauncher(XLAStrategy(), start_method="forkserver"), ValueError, r"choose one of \('spawn'"),
        (lambda: XLAStrategy(timeout=30), TypeError, r"timeout=30\) must be a positive datetime.timedelta"),
        (lambda: XLASPMDStrategy(parameter_sharding="zero3"), ValueError, r"choose one of \['fsdp', 'replicated'\]"),
        (lambda: XLASPMDStrategy(parallel_devices=[torch.device("cuda", 0)]), ValueError, "runs on XLA devices"),
        (
            lambda: XLAFSDPStrategy(state_dict_type="local"),
            ValueError,
            r"state_dict_type='local'.*'full'.*or 'sharded'",
        ),
        (lambda: XLAFSDPStrategy(auto_wrap_policy={1, 2}), TypeError, r"auto_wrap_policy=.* nn.Module class or a"),
        (lambda: XLAFSDPStrategy(auto_wrap_policy="Linear"), TypeError, r"or a callable \(module, recurse"),
        (
            lambda: XLAFSDPStrategy(activation_checkpointing_policy=lambda module, recurse, unwrapped: True),
            TypeError,
            r"activation_checkpointing_policy=.* must be an nn.Module class or a non-empty set of them\.$",
        ),
        (lambda: XLAFSDPStrategy(activation_checkpointing_policy="Linear"), TypeError, r"nn.Module class or a"),
        (lambda: XLAFSDPStrategy(pin_layout_in_collective_ops=True), TypeError, r"sets \['pin_layout_in_collective"),
        (lambda: XLAFSDPStrategy(flatten_parameters=True), TypeError, r"flatten_parameters stays False"),
        (lambda: XLAFSDPStrategy(parallel_devices=[torch.device("cpu")]), ValueError, r"runs on XLA devices, got cpu"),
    ],
)
def test_bad_arguments_are_refused_naming_the_valid_choices(
    build: Callable[[], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    ("device", "expected"), [("xla", "xla:0"), ("xla:1", "xla:1"), (3, "xla:3"), (torch.device("xla", 2), "xla:2")]
)
def test_single_device_accepts_xla_devices_and_indices(device: Any, expected: str) -> None:
    assert SingleDeviceXLAStrategy(device=device).root_device == torch.device(expected)


@pytest.mark.parametrize(
    ("options", "accepted"),
    [
        ({"auto_wrap_policy": torch.nn.Linear}, True),
        ({"auto_wrap_policy": {torch.nn.Linear, torch.nn.Conv2d}}, True),
        ({"auto_wrap_policy": lambda module, recurse, unwrapped_params: False}, True),
        ({"compute_dtype": torch.bfloat16, "reshard_after_forward": False}, True),  # passed to the wrapper
        ({"activation_checkpointing_policy": torch.nn.Linear}, True),
        ({"activation_checkpointing_policy": {torch.nn.Linear}, "auto_wrap_policy": {torch.nn.Conv2d}}, True),
        ({"activation_checkpointing_policy": set()}, False),
        ({"activation_checkpointing_policy": [torch.nn.Linear, int]}, False),
        ({"auto_wrap_policy": set()}, False),
        ({"auto_wrap_policy": [torch.nn.Linear, int]}, False),
    ],
)
def test_xla_fsdp_policies_take_what_lightning_users_write(options: dict[str, Any], accepted: bool) -> None:
    if accepted:
        strategy = XLAFSDPStrategy(**options)
        assert isinstance(strategy, XLAStrategy) and strategy._wrapper_options == {
            key: value
            for key, value in options.items()
            if key not in ("auto_wrap_policy", "activation_checkpointing_policy")
        }
    else:
        with pytest.raises(TypeError, match=rf"XLAFSDPStrategy\({next(iter(options))}="):
            XLAFSDPStrategy(**options)


@pytest.mark.parametrize("precision", ["bf16-true"])
def test_xla_fsdp_refuses_half_precision_weights_at_setup(precision: str) -> None:
    from phalanx.strategies import RunSettings

    strategy = XLAFSDPStrategy(
        accelerator=XLAAccelerator(),
        parallel_devices=[torch.device("xla", 0)],
        precision_plugin=XLAPrecision(precision),
    )
    strategy.connect(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"float32 parameters only .* precision='bf16-mixed'"):
        strategy.setup(RunSettings())


@pytest.mark.parametrize(("host_devices", "refused"), [(2, True), (8, True), (1, False)])
def test_xla_fsdp_on_one_of_several_devices_is_refused_at_setup(
    monkeypatch: pytest.MonkeyPatch, host_devices: int, refused: bool
) -> None:
    from phalanx.strategies import RunSettings
    from phalanx.strategies.xla import fsdp as xla_fsdp

    monkeypatch.setattr(xla_fsdp, "local_device_count", lambda: host_devices)  # asking for real needs torch_xla
    strategy = XLAFSDPStrategy(accelerator=XLAAccelerator(), parallel_devices=[torch.device("xla", 0)])
    strategy.connect(torch.nn.Linear(2, 2))
    if refused:
        with pytest.raises(ValueError, match=rf"1 of this host's {host_devices} XLA devices .* devices={host_devices}"):
            strategy.setup(RunSettings())
    else:  # past the check: the next step places the module on the device, which needs torch_xla
        with pytest.raises(Exception) as caught:
            strategy.setup(RunSettings())
        assert "XLA devices is not supported" not in str(caught.value)


def test_forwards_changed_by_activation_checkpointing_are_given_back() -> None:
    from types import MethodType

    from phalanx.strategies.xla._fsdp_state import undo_activation_checkpointing

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    changed = model[2]
    # What torch_xla's checkpoint_module leaves on a module (its forward replaced by a checkpointing one).
    changed._xla_checkpointed_forward_original = changed.forward
    changed._xla_checkpointed_forward_no_kwargs = MethodType(lambda self, *a: None, changed)
    changed.forward = MethodType(lambda self, x: torch.zeros(1), changed)
    x = torch.ones(4, 2)
    assert torch.equal(model(x), torch.zeros(1))
    undo_activation_checkpointing(model)
    assert not any(name.startswith("_xla_checkpointed") or name == "forward" for name in changed.__dict__)
    assert model(x).shape == (4, 1)


@pytest.mark.parametrize("threads", [True, False])
def test_host_reads_take_turns_only_where_replicas_are_threads(monkeypatch: pytest.MonkeyPatch, threads: bool) -> None:
    from phalanx.strategies.xla import _collectives as xla_collectives

    monkeypatch.setattr(xla_collectives, "threads_share_process", lambda: threads)
    strategy = XLAStrategy()
    with strategy.host_reads():
        # Held by this thread: a second replica thread (or a graph cut) waits; without threads nothing is held.
        assert xla_collectives._STEP_LOCK.locked() is threads
    assert not xla_collectives._STEP_LOCK.locked()


def test_sync_batchnorm_is_refused_at_setup_with_the_reason() -> None:
    from phalanx.plugins.layer_sync import TorchSyncBatchNorm
    from phalanx.strategies import RunSettings

    strategy = XLAStrategy(accelerator=XLAAccelerator(), parallel_devices=[torch.device("xla", 0)])
    strategy.layer_sync = TorchSyncBatchNorm()
    strategy.connect(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"sync_batchnorm=True .* not supported by XLAStrategy"):
        strategy.setup(RunSettings())


# ------------------------------------------------------------------ registry
@pytest.mark.parametrize(
    ("name", "cls", "init_params"),
    [
        ("single_xla", SingleDeviceXLAStrategy, {}),
        ("xla", XLAStrategy, {}),
        ("xla_debug", XLAStrategy, {"debug": True}),
        ("xla_spmd", XLASPMDStrategy, {}),
        ("xla_spmd_dp", XLASPMDStrategy, {"parameter_sharding": "replicated"}),
        ("xla_fsdp", XLAFSDPStrategy, {}),
    ],
)
def test_registry_names(name: str, cls: type, init_params: dict[str, Any]) -> None:
    assert STRATEGY_REGISTRY.get_class(name) is cls
    assert STRATEGY_REGISTRY.init_params(name) == init_params
    built = STRATEGY_REGISTRY.get(name)
    assert isinstance(built, cls)
    if isinstance(built, XLASPMDStrategy):
        assert built.parameter_sharding == init_params.get("parameter_sharding", "fsdp")
        assert (built.launcher, built.world_size, built.distributed_sampler_kwargs) == (None, 1, None)
    if isinstance(built, XLAStrategy):
        assert built.debug == (name == "xla_debug")
        assert built.launch_environment() == ({"PT_XLA_DEBUG_LEVEL": "2"} if built.debug else {})
        assert isinstance(built.cluster_environment, XLAEnvironment)


# ------------------------------------------------------------------ launcher: variables for the launched process
def test_variables_are_set_only_where_unset_and_removed_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT_XLA_DEBUG_LEVEL", "1")  # the user's own value wins and stays
    monkeypatch.delenv("XLA_ENABLE_PARAM_ALIASING", raising=False)
    with _variables({"PT_XLA_DEBUG_LEVEL": "2", "XLA_ENABLE_PARAM_ALIASING": "0"}):
        assert os.environ["PT_XLA_DEBUG_LEVEL"] == "1" and os.environ["XLA_ENABLE_PARAM_ALIASING"] == "0"
    assert os.environ["PT_XLA_DEBUG_LEVEL"] == "1" and "XLA_ENABLE_PARAM_ALIASING" not in os.environ


@pytest.mark.parametrize(
    ("device_type", "threads", "debug", "expected"),
    [
        ("CPU", True, False, {"XLA_ENABLE_PARAM_ALIASING": "0"}),
        ("CPU", False, False, {}),
        ("TPU", True, False, {}),
        ("TPU", True, True, {"PT_XLA_DEBUG_LEVEL": "2"}),
        ("CPU", True, True, {"PT_XLA_DEBUG_LEVEL": "2", "XLA_ENABLE_PARAM_ALIASING": "0"}),
    ],
)
def test_launcher_turns_off_buffer_donation_only_for_cpu_threads(
    monkeypatch: pytest.MonkeyPatch, device_type: str, threads: bool, debug: bool, expected: dict[str, str]
) -> None:
    import phalanx.accelerators.xla as accelerator_module

    monkeypatch.setattr(accelerator_module, "device_type", lambda: device_type)
    launcher = XLALauncher(XLAStrategy(debug=debug), start_method="fork")
    assert launcher._environment(threads=threads) == expected
    assert launcher.is_interactive_compatible


def test_a_strategy_copy_forgets_its_launcher() -> None:
    strategy = XLAStrategy(parallel_devices=[torch.device("xla", 0), torch.device("xla", 1)])
    assert isinstance(strategy.launcher, XLALauncher)
    copied = copy.deepcopy(strategy)
    assert copied._launcher is None and copied.parallel_devices == strategy.parallel_devices
    copied._launched = True
    assert copied.launcher is None  # inside a replica nothing is launched again


# ------------------------------------------------------------------ ranks: per thread for replicas that are threads
def test_rank_zero_helpers_follow_the_rank_of_each_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    seen: dict[int, list[Any]] = {}

    @rank_zero_only
    def only_on_zero() -> str:
        return "ran"

    def replica(rank: int) -> None:
        use_thread_rank(rank)
        rank_zero.set_global_rank(rank)  # what the Trainer does in each replica: must not leak to other threads
        seen[rank] = [rank_zero_only.rank, only_on_zero()]

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in (1, 0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == {0: [0, "ran"], 1: [1, None], 2: [2, None]}
    assert rank_zero_only.rank == 0 and only_on_zero() == "ran"  # the main thread keeps the process's rank


def test_environment_before_launch_is_the_recorded_layout() -> None:
    environment = XLAEnvironment()
    environment.set_world_size(4)
    environment.set_global_rank(0)
    assert (environment.world_size(), environment.global_rank(), environment.local_rank(), environment.node_rank()) == (
        4,
        0,
        0,
        0,
    )
    assert not XLAEnvironment.detect() and not environment.creates_processes_externally


# ------------------------------------------------------------------ helpers
@pytest.mark.parametrize(("length", "padded"), [(0, 256), (1, 256), (256, 256), (257, 512), (1000, 1024), (4097, 8192)])
def test_object_payloads_are_padded_to_few_shapes(length: int, padded: int) -> None:
    assert _padded_length(length) == padded


def test_device_loader_forwards_the_loader_and_copies_without_threads() -> None:
    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    wrapped = DeviceLoader(loader, torch.device("xla", 0))
    assert len(wrapped) == 3 and wrapped.sampler is loader.sampler and wrapped.dataset is data
    assert wrapped.batch_size == 4
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018 - a missing attribute must stay an AttributeError
    wrapped._parallel = object()  # stands for the running background loader
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert clone._parallel is None and len(clone) == 3 and clone.device == torch.device("xla", 0)


def test_checkpoint_conversion_leaves_cpu_data_alone() -> None:
    state = {"w": torch.ones(2), "nested": [torch.zeros(1), {"step": 3}]}
    assert not holds_xla_tensors(state)
    converted = to_cpu(state)
    assert converted["w"] is state["w"] and converted["nested"][1] == {"step": 3}
    assert holds_xla_tensors({"x": [torch.empty(1, device="meta")]}) is False


@pytest.mark.parametrize(
    ("shape", "parts", "spec"),
    [
        ((16, 4), 2, ("data", None)),
        ((1, 16), 2, (None, "data")),  # the first dimension does not divide: the next one is split
        ((3, 5), 2, (None, None)),  # nothing divides: the parameter stays whole on every device
        ((16,), 4, ("data",)),
        ((2, 8), 4, (None, "data")),  # 2 < 4 devices
        ((), 2, ()),
    ],
)
def test_spmd_splits_the_first_dimension_the_device_count_divides(
    shape: tuple[int, ...], parts: int, spec: tuple[str | None, ...]
) -> None:
    assert partition_spec(torch.Size(shape), parts) == spec


@pytest.mark.parametrize(
    "make",
    [
        lambda: SingleDeviceXLAStrategy(device=torch.device("xla", 0), accelerator=XLAAccelerator()),
        lambda: XLAFSDPStrategy(accelerator=XLAAccelerator(), parallel_devices=[torch.device("xla", 0)]),
        lambda: XLAStrategy(accelerator=XLAAccelerator(), parallel_devices=[torch.device("xla", 0)]),
        lambda: XLASPMDStrategy(accelerator=XLAAccelerator(), parallel_devices=[torch.device("xla", 0)]),
    ],
    ids=["single_xla", "xla_fsdp", "xla", "xla_spmd"],
)
def test_xla_strategies_refuse_torch_compile_at_setup(make: Callable[[], Any]) -> None:
    from functools import partial

    from phalanx.strategies import RunSettings

    strategy = make()
    strategy.connect(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"does not run torch.compile: torch_xla traces and compiles every step"):
        strategy.setup(RunSettings(compile=partial(torch.compile, backend="eager")))
