"""The FSDP1 arguments of Lightning's FSDPStrategy, mapped onto FSDP2's ``fully_shard``.

A script written for Lightning passes ``torch.distributed.fsdp`` FSDP1 objects and keyword arguments: ``CPUOffload``,
``MixedPrecision``, ``ShardingStrategy`` members, ``ModuleWrapPolicy`` or policy callables ``(module, recurse,
nonwrapped_numel)``, ``process_group``, ``use_orig_params``, ... Each is translated here into what FSDP2 does; where
FSDP2 has no equivalent, a warning (once per process, on rank zero) says what happens instead. ``torch.distributed``
is imported only when an FSDPStrategy is constructed.
"""

from __future__ import annotations

import inspect
import os
import sys
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Union

import torch
from torch import nn

from phalanx.strategies.parallel_dims import MeshAxis
from phalanx.utilities.rank_zero import rank_zero_warn

#: Which submodules a policy selects: layer classes, a predicate ``module -> bool``, an FSDP1 policy callable
#: ``(module, recurse, nonwrapped_numel) -> bool`` or an FSDP1 policy object (``ModuleWrapPolicy``, ``CustomPolicy``).
ModulePolicy = Union[Iterable[type], type, Callable[..., bool], Any]
#: Picks the submodules a policy selects from a root module, innermost first (the root itself excluded).
ModulePicker = Callable[[nn.Module], "list[nn.Module]"]

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
#: Sharding strategies that keep the gathered parameters from forward to backward (ZeRO-2).
KEEP_GATHERED_AFTER_FORWARD = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
#: Keyword arguments of FSDP1's FullyShardedDataParallel that FSDPStrategy takes besides its named parameters.
SEED_KEYWORD_ARGUMENTS = (
    "process_group",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "ignored_modules",
    "ignored_states",
    "param_init_fn",
    "device_id",
)
_POLICY_FORMS = (
    "a set of nn.Module subclasses, a callable(module) -> bool, an FSDP1 policy callable(module, recurse,"
    " nonwrapped_numel)"
    " -> bool (e.g. functools.partial(transformer_auto_wrap_policy, ...)), or a"
    " torch.distributed.fsdp.wrap.ModuleWrapPolicy"
    " or CustomPolicy"
)

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn on rank zero, once per process for each ``key``, pointing at the user's line that built the strategy."""
    if key in _warned:
        return
    _warned.add(key)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, depth = frame.f_back, depth + 1
    rank_zero_warn(message, stacklevel=depth + 2)


# ---------------------------------------------------------------------------- sharding strategy, offload, precision
def sharding_strategy_name(sharding_strategy: Any) -> str:
    """The canonical name of a ``ShardingStrategy`` member or of its name as a string (any case)."""
    name = (
        getattr(sharding_strategy, "name", sharding_strategy)
        if not isinstance(sharding_strategy, str)
        else sharding_strategy
    )
    if not isinstance(name, str) or name.upper() not in SHARDING_STRATEGIES:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} is not valid; choose one of {list(SHARDING_STRATEGIES)} (a"
            " string in any case, or a torch.distributed.fsdp.ShardingStrategy member)."
        )
    return name.upper()


def cpu_offload_setting(cpu_offload: Any) -> Any:
    """False, True or a ``CPUOffloadPolicy``, from a bool, None, FSDP1's ``CPUOffload`` or a ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy

    if cpu_offload is None or isinstance(cpu_offload, (bool, CPUOffloadPolicy)):
        return bool(cpu_offload) if not isinstance(cpu_offload, CPUOffloadPolicy) else cpu_offload
    if isinstance(cpu_offload, CPUOffload):
        # FSDP1 offloads parameters and gradients and steps the optimizer on the CPU, as FSDP2's policy does.
        return CPUOffloadPolicy() if cpu_offload.offload_params else False
    raise TypeError(
        "cpu_offload must be a bool, None, a torch.distributed.fsdp.CPUOffloadPolicy or an FSDP1 CPUOffload, got"
        f" {type(cpu_offload).__name__}."
    )


def mixed_precision_policy(mixed_precision: Any) -> Any:
    """A ``MixedPrecisionPolicy`` (or None) from one, or from FSDP1's ``MixedPrecision``."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or an FSDP1 MixedPrecision, got"
            f" {type(mixed_precision).__name__}."
        )
    if mixed_precision.buffer_dtype is not None:
        warn_once(
            f"buffer_dtype={mixed_precision.buffer_dtype}",
            f"MixedPrecision(buffer_dtype={mixed_precision.buffer_dtype}): FSDP2 does not cast buffers; they keep"
            " their own dtype"
            " (cast them yourself in configure_model if they must be in that dtype).",
        )
    if mixed_precision.keep_low_precision_grads:
        warn_once(
            "keep_low_precision_grads",
            "MixedPrecision(keep_low_precision_grads=True): FSDP2 keeps the sharded gradients in the parameters'"
            " dtype; reduce_dtype only sets the dtype of the reduction.",
        )
    cast_inputs = bool(mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs)
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=cast_inputs,
    )


# ---------------------------------------------------------------------------- wrap and checkpointing policies
def module_picker(policy: ModulePolicy | None, argument: str) -> ModulePicker | None:
    """A function ``root -> [submodules the policy selects]`` (innermost first), for each policy form the seed takes."""
    if policy is None:
        return None
    from torch.distributed.fsdp.wrap import _Policy

    if isinstance(policy, _Policy):
        return partial(_pick_with_policy_object, policy)
    if isinstance(policy, (type, set, frozenset, list, tuple)):
        classes = tuple(policy) if not isinstance(policy, type) else (policy,)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"{argument} must be {_POLICY_FORMS}; got {policy!r}.")
        return partial(_pick_matching, partial(_is_instance, classes=classes))
    if callable(policy):
        if _takes_recurse(policy, argument):
            return partial(_pick_recursively, policy)
        return partial(_pick_matching, policy)
    raise TypeError(f"{argument} must be {_POLICY_FORMS}; got {type(policy).__name__}.")


def checkpointing_policy(
    activation_checkpointing: Any, activation_checkpointing_policy: ModulePolicy | None
) -> ModulePolicy | None:
    """The seed's deprecated ``activation_checkpointing`` (a layer class or list of them) as a policy."""
    if activation_checkpointing is None:
        return activation_checkpointing_policy
    if activation_checkpointing_policy is not None:
        raise ValueError(
            "Pass activation_checkpointing_policy= only: activation_checkpointing= (deprecated) and"
            " activation_checkpointing_policy= select the same thing."
        )
    classes = [activation_checkpointing] if isinstance(activation_checkpointing, type) else activation_checkpointing
    if not isinstance(classes, (list, tuple, set, frozenset)):
        raise TypeError(
            "activation_checkpointing must be an nn.Module subclass or a list of them, got"
            f" {type(activation_checkpointing).__name__}."
        )
    warn_once(
        "activation_checkpointing",
        "FSDPStrategy(activation_checkpointing=...) is deprecated; pass"
        f" activation_checkpointing_policy={{{', '.join(getattr(c, '__name__', repr(c)) for c in classes)}}} instead.",
    )
    return set(classes)


def _is_instance(module: nn.Module, classes: tuple[type, ...]) -> bool:
    return isinstance(module, classes)


def _innermost_first(root: nn.Module, chosen: Callable[[nn.Module], bool]) -> list[nn.Module]:
    return [module for module in reversed(list(root.modules())) if module is not root and chosen(module)]


def _pick_matching(predicate: Callable[[nn.Module], bool], root: nn.Module) -> list[nn.Module]:
    return _innermost_first(root, predicate)


def _pick_with_policy_object(policy: Any, root: nn.Module) -> list[nn.Module]:
    targets = policy._run_policy(root, set(), {})
    if any(targets.values()):
        warn_once(
            "CustomPolicy arguments",
            "The auto_wrap_policy returned per-module FSDP1 arguments: FSDP2 shards every selected module with the"
            " strategy's own settings, so they are not applied.",
        )
    return _innermost_first(root, lambda module: module in targets)


def _takes_recurse(policy: Callable[..., Any], argument: str) -> bool:
    """Whether ``policy`` is an FSDP1 policy callable ``(module, recurse, nonwrapped_numel)``, not ``(module)``."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin without a signature: a plain predicate
        return False
    named_like_fsdp1 = "recurse" in signature.parameters or "nonwrapped_numel" in signature.parameters
    if not named_like_fsdp1 and _binds(signature, 1):
        return False
    if _binds(signature, 3):
        return True
    raise TypeError(
        f"{argument}={policy!r} can be called neither as (module) nor as (module, recurse, nonwrapped_numel); it must"
        f" be {_POLICY_FORMS}."
    )


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*[None] * count)
    except TypeError:
        return False
    return True


def _call_recursive_policy(policy: Callable[..., Any], module: nn.Module, recurse: bool, numel: int) -> bool:
    # torch calls FSDP1 policies by keyword; older user policies name the third argument differently.
    try:
        names: Mapping[str, Any] = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        names = {}
    if "recurse" in names and "nonwrapped_numel" in names:
        return bool(policy(module=module, recurse=recurse, nonwrapped_numel=numel))
    return bool(policy(module, recurse, numel))


def _pick_recursively(policy: Callable[..., Any], root: nn.Module) -> list[nn.Module]:
    """The modules FSDP1's auto wrapping would wrap: asked top-down whether to descend, bottom-up whether to wrap what
    is left."""
    picked: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        total = sum(p.numel() for p in module.parameters())
        if not _call_recursive_policy(policy, module, True, total):
            return 0
        claimed = sum(visit(child, False) for child in module.children())
        if not is_root and _call_recursive_policy(policy, module, False, total - claimed):
            picked.append(module)
            return total
        return claimed

    visit(root, True)
    return list({id(module): module for module in picked}.values())  # a module shared by two parents: wrapped once


# ---------------------------------------------------------------------------- FSDP1 keyword arguments
def seed_keyword_arguments(kwargs: dict[str, Any], fully_shard_names: set[str]) -> tuple[dict[str, Any], Any]:
    """Split ``kwargs`` into ``fully_shard`` arguments and the FSDP1 ``process_group``; warn about FSDP1 options FSDP2
    lacks.

    A name neither ``fully_shard`` nor FSDP1 knows raises TypeError.
    """
    unknown = sorted(set(kwargs) - fully_shard_names - set(SEED_KEYWORD_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"FSDPStrategy got unexpected keyword argument(s) {unknown}. "
            f"Extra keyword arguments go to fully_shard, which accepts {sorted(fully_shard_names)}, "
            f"or are FSDP1 arguments of Lightning's FSDPStrategy: {sorted(SEED_KEYWORD_ARGUMENTS)}."
        )
    fully_shard_kwargs = {name: value for name, value in kwargs.items() if name in fully_shard_names}
    for name in SEED_KEYWORD_ARGUMENTS:
        if name in kwargs and name not in ("process_group", "ignored_modules", "ignored_states"):
            _explain_seed_option(name, kwargs[name])
    ignored = [*_as_list(kwargs.get("ignored_modules")), *_as_list(kwargs.get("ignored_states"))]
    if ignored:
        # FSDP1 leaves these modules' parameters unsharded; FSDP2 calls that ignored_params.
        parameters = {p for item in ignored for p in (item.parameters() if isinstance(item, nn.Module) else [item])}
        fully_shard_kwargs["ignored_params"] = set(fully_shard_kwargs.get("ignored_params") or ()) | parameters
    return fully_shard_kwargs, kwargs.get("process_group")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (nn.Module, torch.Tensor)):
        return [value]
    return list(value)


def _explain_seed_option(name: str, value: Any) -> None:
    """Warn where FSDP2 does something else than the FSDP1 option ``name=value`` asks for (silent where it does the
    same)."""
    fsdp2 = {
        (
            "use_orig_params",
            False,
        ): "FSDP2 has no flat parameters: optimizers always see the module's own parameters (as sharded DTensors), as"
        " with use_orig_params=True.",
        (
            "limit_all_gathers",
            False,
        ): "FSDP2 has no all-gather rate limiter to turn off; it bounds the all-gathers in flight itself (one layer"
        " prefetched ahead).",
        (
            "forward_prefetch",
            True,
        ): "FSDP2 overlaps the next layer's all-gather implicitly; for explicit prefetching call"
        " set_modules_to_forward_prefetch([...]) on the sharded layers (e.g. in on_fit_start).",
        (
            "sync_module_states",
            False,
        ): "phalanx broadcasts rank 0's initial weights before sharding anyway (modules created on the meta device are"
        " initialised alike on every rank), as with sync_module_states=True.",
    }
    if name == "backward_prefetch":
        prefetch = getattr(value, "name", value)
        if prefetch != "BACKWARD_PRE":
            warn_once(
                f"{name}={prefetch}",
                f"FSDPStrategy(backward_prefetch={prefetch}): FSDP2 always prefetches the next layer's all-gather"
                " before computing the current layer's gradients (as BACKWARD_PRE); for explicit control call"
                " set_modules_to_backward_prefetch([...]) on the sharded layers.",
            )
    elif name == "param_init_fn":
        warn_once(
            name,
            "FSDPStrategy(param_init_fn=...): not called; phalanx materialises modules created on the meta device"
            " (tensor_init_context(empty_init=True)) with each module's reset_parameters().",
        )
    elif name == "device_id":
        warn_once(
            name,
            "FSDPStrategy(device_id=...): ignored; each process shards onto its own device (the Trainer's devices=).",
        )
    elif (name, bool(value)) in fsdp2:
        warn_once(f"{name}={bool(value)}", f"FSDPStrategy({name}={value!r}): {fsdp2[(name, bool(value))]}")


# ---------------------------------------------------------------------------- meshes from FSDP1 process groups
def check_process_group(process_group: Any, hybrid: bool) -> None:
    """FSDP1's ``process_group``: one ProcessGroup, or for hybrid sharding a pair ``(shard_group, replicate_group)``."""
    if process_group is None:
        return
    from torch.distributed import ProcessGroup

    if not hybrid and not isinstance(process_group, ProcessGroup):
        raise ValueError(
            "process_group must be one ProcessGroup for this sharding strategy (a pair (shard_group, replicate_group)"
            f" is for hybrid sharding), got {type(process_group).__name__}."
        )
    if hybrid and not (
        isinstance(process_group, tuple)
        and len(process_group) == 2
        and all(isinstance(g, ProcessGroup) for g in process_group)
    ):
        raise ValueError(
            "Hybrid sharding needs process_group=(shard_group, replicate_group), a pair of ProcessGroups, got"
            f" {process_group!r}."
        )


def mesh_from_process_group(
    process_group: Any, hybrid: bool, device_type: str, gather: Callable[[Any], list[Any]]
) -> Any:
    """A DeviceMesh over FSDP1's ``process_group`` (see check_process_group); ``gather`` is all_gather_object over every
    process."""
    from torch.distributed import get_process_group_ranks, get_rank
    from torch.distributed.device_mesh import DeviceMesh

    check_process_group(process_group, hybrid)
    if not hybrid:
        return DeviceMesh.from_group(process_group, device_type, mesh_dim_names=(MeshAxis.DATA_SHARD.value,))
    shard_group, replicate_group = process_group
    # Every process tells its shard group: the rows of the (replicate, shard) mesh.
    rows = sorted({tuple(ranks) for ranks in gather(get_process_group_ranks(shard_group))})
    disjoint = len({rank for row in rows for rank in row}) == sum(len(row) for row in rows)
    mesh = torch.tensor(rows, dtype=torch.int) if disjoint and len({len(row) for row in rows}) == 1 else None
    column = None if mesh is None else int((mesh == get_rank()).nonzero()[0, 1])
    if mesh is None or sorted(mesh[:, column].tolist()) != sorted(get_process_group_ranks(replicate_group)):
        raise ValueError(
            "process_group=(shard_group, replicate_group) must split the processes into disjoint shard groups of one"
            f" size (here {[list(r) for r in rows]}) whose members at the same position form the replicate groups."
        )
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=mesh,
        mesh_dim_names=(MeshAxis.DATA_REPLICATE.value, MeshAxis.DATA_SHARD.value),
    )
