"""The Trainer's and the Cohort's properties about where they run, read from their strategy (as Lightning's Trainer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.accelerators.accelerator import Accelerator
    from phalanx.plugins.precision.precision import Precision
    from phalanx.strategies.strategy import Strategy


class DeviceProperties:
    """The ranks and the world size, ``accelerator``, ``precision_plugin``, ``device_ids`` and ``num_devices`` of the
    Trainer's strategy."""

    strategy: Strategy

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This node's rank."""
        return self.strategy.node_rank

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return self.strategy.world_size

    @property
    def num_nodes(self) -> int:
        """The number of nodes."""
        return self.strategy.num_nodes

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self.strategy.is_global_zero

    @property
    def accelerator(self) -> Accelerator | None:
        """The Accelerator instance the strategy runs on."""
        return self.strategy.accelerator

    @property
    def precision_plugin(self) -> Precision:
        """The strategy's precision plugin."""
        return self.strategy.precision_plugin

    @property
    def device_ids(self) -> list[int]:
        """The indices of the devices this node's processes use (their position in the list for CPU devices)."""
        devices = getattr(self.strategy, "parallel_devices", None) or [self.strategy.root_device]
        return [position if device.index is None else device.index for position, device in enumerate(devices)]

    @property
    def num_devices(self) -> int:
        """The number of devices per node (one process each)."""
        return len(self.device_ids)


__all__ = ["DeviceProperties"]
