"""Staging: copying a checkpoint's tensors off the training tensors, into CPU buffers kept between saves.

Allocating a fresh copy of every tensor at each save costs the page faults of touching new memory, often more than
the copy itself; with the buffers kept, staging is one memory copy. They hold one more copy of the checkpoint's
tensors between saves; AsyncCheckpointIO reuses them only once the save that used them has been written.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch


class StagingBuffers:
    """CPU copies of a checkpoint's tensors, by their place in the checkpoint; ``reuse=False`` allocates each time."""

    def __init__(self, *, reuse: bool = True) -> None:
        self.reuse = reuse
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, data: Any, key: tuple[Any, ...] = ()) -> Any:
        """``data`` with every tensor replaced by its CPU copy (containers rebuilt, other values shared)."""
        if isinstance(data, torch.Tensor):
            return self._copy(data, key)
        if isinstance(data, (list, tuple)):
            items = [self.stage(item, (*key, index)) for index, item in enumerate(data)]
            if type(data) is list:
                return items
            return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
        if isinstance(data, Mapping):
            mapped = {name: self.stage(value, (*key, name)) for name, value in data.items()}
            if type(data) is dict:
                return mapped
            if isinstance(data, defaultdict):
                return type(data)(data.default_factory, mapped)
            return type(data)(mapped)  # type: ignore[call-arg]  # a Mapping subclass built from a dict
        return data

    def _copy(self, tensor: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor:
        dtensors = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (it costs ~1 s)
        if dtensors is not None and isinstance(
            tensor, dtensors.DTensor
        ):  # this rank's shard is copied; the copy is a DTensor laid out like the original
            from torch.distributed.tensor import DTensor

            local = self._copy(tensor.to_local(), (*key, "local"))
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                shape=tensor.shape,
                stride=tensor.stride(),
                run_check=False,
            )
        source = tensor.detach()
        buffer = self._buffers.get(key) if self.reuse else None
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            if self.reuse:
                self._buffers[key] = buffer
        buffer.copy_(source)
        return buffer

    def clear(self) -> None:
        """Drop the buffers (their memory is freed once no pending write uses them)."""
        self._buffers.clear()


class StagedAlready:
    """DCP's ``AsyncStager`` for a state dict that ``StagingBuffers`` copied already: DCP then copies nothing more."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Nothing to wait for: the copy is done."""
        return False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """The state dict, as it is."""
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""
