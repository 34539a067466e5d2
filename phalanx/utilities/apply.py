"""Apply a function to every tensor inside nested plain containers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``data`` with ``fn`` applied to each tensor in lists, tuples, dicts and dataclass-like namedtuples."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        items = [apply_to_tensors(item, fn) for item in data]
        if type(data) is list:
            return items
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Mapping):
        mapped = {key: apply_to_tensors(value, fn) for key, value in data.items()}
        if type(data) is dict:
            return mapped
        if isinstance(data, defaultdict):
            return type(data)(data.default_factory, mapped)  # its first argument is the factory, not the items
        return type(data)(mapped)
    return data


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_cpu else tensor.cpu()


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor in ``data`` to ``device`` (non-blocking from pinned memory to an accelerator)."""
    if device.type == "cpu":
        # The common CPU case: tensors are already there, and `.to()` would still cost a dispatcher round trip.
        if type(data) in (list, tuple):
            # A plain loop: a generator inside all() would cost a Python call per item, every batch.
            for item in data:
                if type(item) is not torch.Tensor or not item.is_cpu:
                    break
            else:
                return data
        return apply_to_tensors(data, _to_cpu)
    return apply_to_tensors(data, lambda t: t.to(device, non_blocking=t.is_pinned()))
