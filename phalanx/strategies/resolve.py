"""Turning the Trainer's arguments into one fully wired Strategy (a pure function of those arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.registry import ACCELERATOR_REGISTRY
from phalanx.plugins import NOT_OFFERED as NOT_OFFERED_PLUGINS
from phalanx.plugins.environments import detect_cluster_environment
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from phalanx.plugins.precision.precision import Precision
from phalanx.plugins.precision.selection import precision_plugin_for
from phalanx.strategies.launchers.launcher import in_interactive_session
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.registry import STRATEGY_REGISTRY
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.traits import check_traits
from phalanx.utilities.messages import reject_class, shown
from phalanx.utilities.rank_zero import rank_zero_warn

PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_PRECISION_ALIASES: dict[Any, str] = {
    32: "32-true", "32": "32-true",
    64: "64-true", "64": "64-true",
    16: "16-mixed", "16": "16-mixed",
    "bf16": "bf16-mixed",
}  # fmt: skip


#: Lightning Fabric's strategy and precision names that phalanx will not offer, with what to use instead.
NOT_OFFERED_STRATEGIES = {
    "dp": "strategy='ddp' (one process per device; torch recommends DistributedDataParallel over DataParallel, which"
    " drives every device from one process)",
}
NOT_OFFERED_PRECISIONS = {
    name: "precision='bf16-mixed' or 'bf16-true', with Transformer Engine's layers in your module for FP8"
    for name in ("transformer-engine", "transformer-engine-float16")
}


def normalize_precision(precision: Any) -> str:
    """Map a precision argument (with the aliases 32, 64, 16, 'bf16'; None for the default) to its canonical name."""
    if precision is None:
        return "32-true"  # Lightning's None: "the default" (or the precision plugin given in plugins=)
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    if isinstance(precision, (int, str)) and not isinstance(precision, bool) and precision in _PRECISION_ALIASES:
        return _PRECISION_ALIASES[precision]
    if isinstance(precision, Precision) or (isinstance(precision, type) and issubclass(precision, Precision)):
        example = precision.__qualname__ if isinstance(precision, type) else type(precision).__qualname__
        raise TypeError(
            f"precision={shown(precision)} is a precision plugin; pass a plugin instance in plugins=[{example}()], or"
            f" a name in precision= ({list(PRECISIONS)})."
        )
    if isinstance(precision, str) and precision in NOT_OFFERED_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} (Lightning Fabric's) is not offered by phalanx; use"
            f" {NOT_OFFERED_PRECISIONS[precision]}."
        )
    raise ValueError(
        f"precision={shown(precision)} is not supported. "
        f"Choose one of {list(PRECISIONS)} (aliases: 32, 64, 16, 'bf16')."
    )


def resolve_accelerator(accelerator: str | Accelerator) -> Accelerator:
    """Return the Accelerator for a name ('cpu', 'cuda', 'gpu', 'mps', 'auto', or registered) or an instance."""
    if isinstance(accelerator, Accelerator):
        return accelerator
    # The names are listed only for an error: listing them loads every installed plugin.
    if isinstance(accelerator, type):
        reject_class("accelerator", accelerator, Accelerator, f"a name: {_accelerator_names()}")
    if not isinstance(accelerator, str):
        raise TypeError(
            f"accelerator={shown(accelerator)} (of type {type(accelerator).__name__}) is not valid; pass a name"
            f" ({_accelerator_names()}) or an Accelerator instance."
        )
    name = accelerator.lower()
    if name == "auto":
        for candidate in ("cuda", "mps"):
            if ACCELERATOR_REGISTRY.get_class(candidate).is_available():  # type: ignore[attr-defined]
                return ACCELERATOR_REGISTRY.get(candidate)
        return ACCELERATOR_REGISTRY.get("cpu")
    if name == "gpu":
        for candidate in ("cuda", "mps"):
            if ACCELERATOR_REGISTRY.get_class(candidate).is_available():  # type: ignore[attr-defined]
                return ACCELERATOR_REGISTRY.get(candidate)
        raise ValueError(
            "accelerator='gpu' was requested, but neither CUDA nor MPS is available on this machine. Use"
            " accelerator='cpu' (or 'auto')."
        )
    if name not in ACCELERATOR_REGISTRY:
        raise ValueError(
            f"Unknown accelerator {accelerator!r}.{ACCELERATOR_REGISTRY.suggestion(accelerator, ('auto', 'gpu'))}"
            f" Choose one of {_accelerator_names()}, or pass an Accelerator instance."
            f"{ACCELERATOR_REGISTRY.failed_plugins_note()}"
        )
    accelerator_class = ACCELERATOR_REGISTRY.get_class(name)
    if not accelerator_class.is_available():  # type: ignore[attr-defined]
        usable = [n for n in ACCELERATOR_REGISTRY.available() if ACCELERATOR_REGISTRY.get_class(n).is_available()]  # type: ignore[attr-defined]
        hint = " (torch.cuda.is_available() is False)" if name == "cuda" else accelerator_class.unavailable_hint()  # type: ignore[attr-defined]
        raise ValueError(
            f"accelerator={accelerator!r} was requested but is not available on this machine{hint}. Available"
            f" accelerators: {usable}."
        )
    return ACCELERATOR_REGISTRY.get(name)


def _accelerator_names() -> list[str]:
    return ["auto", "gpu", *ACCELERATOR_REGISTRY.available()]


def refuse_not_offered_plugin(name: str, plugin: Any) -> None:
    """Raise TypeError naming the alternative for a Lightning plugin phalanx will not offer (e.g. bitsandbytes')."""
    kind = type(plugin).__name__
    entry = NOT_OFFERED_PLUGINS.get(kind)
    if entry is not None and not type(plugin).__module__.startswith("phalanx."):
        raise TypeError(f"{name}={kind}(...) is Lightning's plugin, which phalanx does not offer; use {entry.instead}.")


class _Plugins:
    """The plugins passed to the Trainer, sorted by kind."""

    def __init__(self, plugins: Any) -> None:
        self.precision: Precision | None = None
        self.checkpoint_io: CheckpointIO | None = None
        self.cluster_environment: ClusterEnvironment | None = None
        self.layer_sync: LayerSync | None = None
        listed = isinstance(plugins, Sequence) and not isinstance(plugins, str)
        items = [] if plugins is None else list(plugins) if listed else [plugins]
        kinds = {
            Precision: "precision",
            CheckpointIO: "checkpoint_io",
            ClusterEnvironment: "cluster_environment",
            LayerSync: "layer_sync",
        }
        valid = "valid plugins are Precision, CheckpointIO, ClusterEnvironment and LayerSync instances"
        for index, plugin in enumerate(items):
            name = f"plugins[{index}]" if listed else "plugins"
            for kind in kinds:
                reject_class(name, plugin, kind, "")
            slot = next((slot for kind, slot in kinds.items() if isinstance(plugin, kind)), None)
            refuse_not_offered_plugin(name, plugin)
            if slot is None:
                raise TypeError(f"{name}={shown(plugin)} (of type {type(plugin).__name__}) is not valid; {valid}.")
            if getattr(self, slot) is not None:
                raise ValueError(f"plugins holds more than one {slot.replace('_', ' ')} plugin; pass only one.")
            setattr(self, slot, plugin)


def resolve_strategy(
    *,
    accelerator: str | Accelerator = "auto",
    strategy: str | Strategy = "auto",
    devices: Any = "auto",
    num_nodes: int = 1,
    precision: Any = "32-true",
    plugins: Any = None,
    sync_batchnorm: bool = False,
) -> Strategy:
    """Build the Strategy the Trainer will use, with its accelerator, precision plugin and checkpoint IO attached."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1.")
    precision_name = normalize_precision(precision)
    given = _Plugins(plugins)
    if sync_batchnorm and given.layer_sync is not None and not isinstance(given.layer_sync, TorchSyncBatchNorm):
        raise ValueError(
            f"sync_batchnorm=True and the {type(given.layer_sync).__name__} plugin both say how to synchronise layers."
            " Choose one: drop sync_batchnorm=True to use your plugin, or drop the plugin for torch's SyncBatchNorm."
        )
    if given.precision is not None and precision_name != "32-true":
        raise ValueError(
            f"Both precision={precision!r} and a Precision plugin ({type(given.precision).__name__}) "
            "were given; pass only one."
        )
    if isinstance(strategy, Strategy):
        built = _complete_strategy_instance(strategy, accelerator, precision_name, given.precision, given.checkpoint_io)
        refuse_unfit_strategy(type(built), built.accelerator, f"a {type(built).__name__} instance")
        if isinstance(built, ParallelStrategy):
            assert built.accelerator is not None
            devices_of_built = built.parallel_devices or built.accelerator.get_parallel_devices(devices)
            _configure_parallel(built, devices_of_built, num_nodes, sync_batchnorm, given)
        refuse_in_interactive_session(built, built)
        check_traits(built)  # here, once: the loops read them later, where a bad one would only be misread
        return built
    if isinstance(strategy, type):  # listing the names loads every installed plugin: only for an error
        reject_class("strategy", strategy, Strategy, f"a registered name: {['auto', *STRATEGY_REGISTRY.available()]}")
    if not isinstance(strategy, str):
        raise TypeError(
            f"strategy={shown(strategy)} (of type {type(strategy).__name__}) is not valid; pass a registered name"
            f" ({['auto', *STRATEGY_REGISTRY.available()]}) or a Strategy instance."
        )
    accelerator_instance = resolve_accelerator(accelerator)
    built = _build_registered(
        strategy, accelerator_instance, devices, num_nodes, precision_name, sync_batchnorm=sync_batchnorm, given=given
    )
    refuse_in_interactive_session(built, strategy)
    check_traits(built)
    return built


def refuse_in_interactive_session(strategy: Strategy, shown_strategy: Any) -> None:
    """In a notebook or interactive interpreter, refuse a strategy whose launcher cannot start processes from there
    (re-running a script, spawn); fork ('ddp_notebook') can."""
    if not in_interactive_session():
        return  # the launcher is built only here: in a script nothing changes
    launcher = strategy.launcher
    if launcher is not None and not launcher.is_interactive_compatible:
        raise ValueError(
            f"strategy={shown(shown_strategy)} cannot start its processes from an interactive session (notebook,"
            " IPython, python -i). Use strategy='ddp_notebook' (processes started with fork), or run your code as a"
            " script. If you start the processes yourself, create the Trainer inside the worker function."
        )


def _registered_name(strategy: str, devices: Any, num_nodes: int, process_count: int, accelerator: Accelerator) -> str:
    """The registry name ``strategy`` stands for ('auto': the accelerator's choice, e.g. DDP for several processes)."""
    name = strategy.lower()
    if name == "auto":
        name = accelerator.auto_strategy(process_count)  # 'ddp'/'single_device'; 'xla'/'single_xla' on XLA devices
        if name == "ddp" and num_nodes == 1 and in_interactive_session():
            name = "ddp_notebook"  # 'ddp' re-runs a script, which a notebook does not have; fork works there
        if process_count > 1 and name not in STRATEGY_REGISTRY:
            raise ValueError(
                f"devices={devices!r} with num_nodes={num_nodes} asks for {process_count} processes, which needs a"
                f" parallel strategy; registered strategies: {STRATEGY_REGISTRY.available()}."
            )
    if name in NOT_OFFERED_STRATEGIES and name not in STRATEGY_REGISTRY:
        raise ValueError(
            f"strategy={strategy!r} (Lightning Fabric's) is not offered by phalanx; use {NOT_OFFERED_STRATEGIES[name]}."
        )
    if name not in STRATEGY_REGISTRY:
        raise ValueError(
            f"Unknown strategy {strategy!r}.{STRATEGY_REGISTRY.suggestion(strategy, ('auto',))} Choose 'auto' or one"
            f" of {STRATEGY_REGISTRY.available()}, or pass a Strategy instance."
            f"{STRATEGY_REGISTRY.failed_plugins_note()}"
        )
    return name


def _build_registered(
    strategy: str,
    accelerator: Accelerator,
    devices: Any,
    num_nodes: int,
    precision_name: str,
    *,
    sync_batchnorm: bool,
    given: _Plugins,
) -> Strategy:
    # A strategy named in the registry, built and completed with the Trainer's arguments.
    parallel_devices = accelerator.get_parallel_devices(devices)
    process_count = len(parallel_devices) * num_nodes
    name = _registered_name(strategy, devices, num_nodes, process_count, accelerator)
    strategy_class = STRATEGY_REGISTRY.get_class(name)
    if isinstance(strategy_class, type):  # a registered factory function has no class to check
        refuse_unfit_strategy(strategy_class, accelerator, repr(strategy))
    make_plugin = getattr(strategy_class, "precision_plugin_for", None) or precision_plugin_for
    plugin = given.precision if given.precision is not None else make_plugin(precision_name, accelerator)
    if name == "single_device" or (
        isinstance(strategy_class, type) and issubclass(strategy_class, SingleDeviceStrategy)
    ):
        if process_count > 1:
            raise ValueError(
                f"strategy={strategy!r} runs one process, but devices={devices!r}, num_nodes={num_nodes} asks for"
                f" {process_count}. Use a parallel strategy such as 'ddp', or devices=1."
            )
        if sync_batchnorm:
            rank_zero_warn("sync_batchnorm=True has no effect with a single device.")
        return STRATEGY_REGISTRY.get(
            name,
            device=parallel_devices[0],
            accelerator=accelerator,
            precision_plugin=plugin,
            checkpoint_io=given.checkpoint_io,
        )
    built = STRATEGY_REGISTRY.get(name)
    built.accelerator = accelerator
    built.precision_plugin = plugin
    if given.checkpoint_io is not None:
        built.checkpoint_io = given.checkpoint_io
    if isinstance(built, ParallelStrategy):
        _configure_parallel(built, parallel_devices, num_nodes, sync_batchnorm, given)
    elif process_count > 1:
        raise ValueError(
            f"strategy={strategy!r} is not a parallel strategy, but devices={devices!r}, num_nodes={num_nodes} asks"
            f" for {process_count} processes."
        )
    return built


def refuse_unfit_strategy(strategy_class: type, accelerator: Accelerator | None, shown_strategy: str) -> None:
    """Refuse, before anything is built, a strategy that the accelerator's declared limits rule out."""
    if accelerator is None:
        return
    refuse_other_family(strategy_class, accelerator, shown_strategy)
    refuse_too_many_processes(strategy_class, accelerator, shown_strategy)


def refuse_other_family(strategy_class: type, accelerator: Accelerator, shown_strategy: str) -> None:
    """Refuse a strategy outside the one family the accelerator runs (XLA devices: the XLA strategies).

    The others would put their tensors on XLA devices and fail much later, in torch.distributed's CPU or CUDA backends
    or in a launcher that starts one process per device without torch_xla's runtime.
    """
    family = accelerator.strategy_family
    if family is None or getattr(strategy_class, "family", None) == family:
        return
    names = []
    for name in STRATEGY_REGISTRY.available():
        candidate = STRATEGY_REGISTRY.get_class(name)
        if isinstance(candidate, type) and getattr(candidate, "family", None) == family:
            names.append(name)
    kind = family.upper()
    raise ValueError(
        f"strategy={shown_strategy} does not run on {kind} devices (accelerator={accelerator.name!r})."
        f" Use one of the {kind} strategies, {names} (or strategy='auto'),"
        " or keep this strategy and pass accelerator='cpu' or 'cuda'."
    )


def refuse_too_many_processes(strategy_class: type, accelerator: Accelerator, shown_strategy: str) -> None:
    """Refuse a multi-process strategy (DDP, FSDP, DeepSpeed, ...) where the accelerator runs one process (MPS: one
    device without a collective-communication backend; Lightning refuses them there too)."""
    limit = accelerator.max_processes
    if limit is None or limit > 1 or not getattr(strategy_class, "multi_process", False):
        return
    kind = accelerator.name.upper()
    raise ValueError(
        f"strategy={shown_strategy} runs several processes that communicate, which the {kind} accelerator"
        f" ({accelerator.max_processes_reason}) does not support."
        f" Train on {kind} with strategy='auto' (or 'single_device'), or keep this strategy and pass accelerator='cpu'."
    )


def _configure_parallel(
    strategy: ParallelStrategy,
    parallel_devices: list[torch.device],
    num_nodes: int,
    sync_batchnorm: bool,
    given: _Plugins,
) -> None:
    # The Trainer's arguments fill what the strategy left unset; the environment must agree with them.
    if strategy.parallel_devices is None:
        strategy.parallel_devices = parallel_devices
    strategy.num_nodes = num_nodes
    if given.cluster_environment is not None:
        strategy.cluster_environment = given.cluster_environment
    elif strategy.cluster_environment is None:
        strategy.cluster_environment = detect_cluster_environment()
    strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes, num_nodes=num_nodes)
    if given.layer_sync is not None:
        strategy.layer_sync = given.layer_sync
    elif sync_batchnorm:
        if all(device.type == "cpu" for device in strategy.parallel_devices or []):
            raise ValueError(
                "sync_batchnorm=True needs GPUs: torch's SyncBatchNorm does not run on the CPU. Remove it, or train"
                " with accelerator='cuda'."
            )
        strategy.layer_sync = TorchSyncBatchNorm()
    strategy.record_global_rank()


def _complete_strategy_instance(
    strategy: Strategy,
    accelerator: str | Accelerator,
    precision_name: str,
    precision_plugin: Precision | None,
    checkpoint_io: CheckpointIO | None,
) -> Strategy:
    # A user's strategy instance keeps the parts it was built with; the Trainer's arguments fill in the rest.
    if strategy.accelerator is None:
        if isinstance(accelerator, Accelerator):
            strategy.accelerator = accelerator
        elif accelerator in ("auto", None):
            device_type = strategy.root_device.type if _has_root_device(strategy) else "cpu"
            strategy.accelerator = resolve_accelerator(device_type if device_type in ACCELERATOR_REGISTRY else "auto")
        else:
            strategy.accelerator = resolve_accelerator(accelerator)
    elif (
        accelerator not in ("auto", None)
        and not (isinstance(accelerator, str) and accelerator.lower() == getattr(strategy.accelerator, "name", None))
        and accelerator is not strategy.accelerator
    ):
        raise ValueError(
            f"accelerator={accelerator!r} conflicts with the accelerator of the strategy instance"
            f" ({type(strategy.accelerator).__name__}); set it in one place."
        )
    if strategy._precision_plugin is None:
        strategy.precision_plugin = (
            precision_plugin
            if precision_plugin is not None
            else type(strategy).precision_plugin_for(precision_name, strategy.accelerator)
        )
    elif precision_plugin is not None or precision_name != "32-true":
        raise ValueError(
            f"The strategy instance already has a precision plugin ({type(strategy.precision_plugin).__name__}); do"
            " not also pass precision= or a Precision plugin."
        )
    if checkpoint_io is not None:
        if strategy._checkpoint_io is not None:
            raise ValueError("The strategy instance already has a CheckpointIO; do not also pass one in plugins.")
        strategy.checkpoint_io = checkpoint_io
    return strategy


def _has_root_device(strategy: Strategy) -> bool:
    try:
        strategy.root_device  # noqa: B018 - a property that may need setup
    except Exception:
        return False
    return True


__all__ = [
    "PRECISIONS",
    "normalize_precision",
    "precision_plugin_for",
    "refuse_in_interactive_session",
    "resolve_accelerator",
    "resolve_strategy",
]
