"""torchmetrics objects given to ``self.log`` or a Cohort's logging, recognised without importing torchmetrics.

torchmetrics stays optional: a ``Metric`` can only exist once the user's code has imported torchmetrics, so looking it
up in ``sys.modules`` answers every question without loading it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from phalanx.utilities.exceptions import MisconfigurationError


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.Metric`` (always False while torchmetrics is not imported)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def is_metric_collection(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.MetricCollection`` (always False while torchmetrics is not imported)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.MetricCollection)


def loggable_items(values: Any) -> Mapping[str, Any]:
    """What ``log_dict(values)`` logs: a mapping as it is, a ``MetricCollection`` as a dict of its metrics under the
    names they log as (its prefix and postfix applied); a TypeError for anything else."""
    if not is_metric_collection(values):
        if not isinstance(values, Mapping):
            kind = type(values).__name__
            raise TypeError(
                f"log_dict expects a mapping of names to values or a torchmetrics MetricCollection, got {kind}."
            )
        return values
    options = {"keep_base": False}
    if getattr(values, "_enable_compute_groups", False):
        # Members of a compute group share one state; copying it per member would make them drift apart.
        options["copy_state"] = False
    return dict(values.items(**options))


def check_metric_attribute(module: nn.Module, metric: Any, name: str) -> str:
    """The name of ``metric`` among the submodules of ``module``; a MisconfigurationError when it is not one.

    As in Lightning: a Metric logged without ``metric_attribute`` must be an attribute of the module, which also
    makes it follow the module to its device.
    """
    names = {id(sub): sub_name for sub_name, sub in module.named_modules() if is_metric(sub)}
    found = names.get(id(metric))
    if found is not None:
        return found
    kind = type(metric).__name__
    among = f" ({', '.join(sorted(names.values()))})" if names else ""
    raise MisconfigurationError(
        f"self.log({name!r}, <{kind}>) logs a torchmetrics Metric that is not an attribute of {type(module).__name__}."
        f" Assign it in __init__ (e.g. self.metric = {kind}(...)) so that it moves to the module's device with it,"
        f" or pass metric_attribute= with the name of the attribute that holds it{among}."
    )


def own_metric_states(module: nn.Module) -> None:
    """Give each Metric under ``module`` its own copy of every state tensor that arrived in shared memory.

    Metric states are plain attributes (neither parameters nor buffers), so a module handed to spawned processes
    brings them in the storage all processes share: every rank's update would land in the same counts.
    """
    for sub in module.modules():
        if not is_metric(sub):
            continue
        for state in getattr(sub, "_defaults", {}):
            value = getattr(sub, state)
            if isinstance(value, Tensor) and value.is_shared():
                setattr(sub, state, value.clone())
            elif isinstance(value, list) and any(isinstance(item, Tensor) and item.is_shared() for item in value):
                setattr(sub, state, [item.clone() if isinstance(item, Tensor) else item for item in value])


__all__ = ["check_metric_attribute", "is_metric", "is_metric_collection", "loggable_items", "own_metric_states"]
