"""SingleDeviceStrategy: one process, one device."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.distributed import normalize_reduce_op
from phalanx.utilities.registry import Registry

_T = TypeVar("_T")


class SingleDeviceStrategy(Strategy):
    """Trains in this process on one device (CPU, one GPU or MPS)."""

    def __init__(
        self,
        device: str | int | torch.device = "cpu",
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if isinstance(device, int):
            device = torch.device("cuda", device)
        try:
            self._root_device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"SingleDeviceStrategy got device={device!r}, which is not a torch device: {error}"
            ) from None

    @property
    def root_device(self) -> torch.device:
        """The one device."""
        return self._root_device

    def model_to_device(self) -> None:
        """Move the module to the device."""
        assert self._module is not None
        self._module.to(self._root_device)

    @property
    def is_global_zero(self) -> bool:
        """Always True."""
        return True

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: str | None = "mean") -> Tensor | Any:
        """Nothing to reduce across one process (``reduce_op`` is still checked, as it would be on several)."""
        normalize_reduce_op(reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for."""

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Nothing to send."""
        return obj

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """One process: the tensor itself."""
        return tensor

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register "single_device"."""
        registry.register("single_device", cls, description="One process on one device.")
