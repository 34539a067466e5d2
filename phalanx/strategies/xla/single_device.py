"""SingleDeviceXLAStrategy ("single_xla"): one XLA device (a TPU core, or the PJRT CPU runtime) in this process."""

from __future__ import annotations

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.xla._common import XLAStrategyMixin, xla_device
from phalanx.utilities.registry import Registry


class SingleDeviceXLAStrategy(XLAStrategyMixin, SingleDeviceStrategy):
    """Trains in this process on one XLA device; each optimizer step is one compiled graph.

    The graph is cut after every optimizer step (and by the dataloader before each batch), the dataloader moves
    batches to the device in the background, and checkpoints hold CPU tensors (they load with ``weights_only=True``
    in a process without torch_xla).
    """

    def __init__(
        self,
        device: str | int | torch.device = "xla:0",
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            device=xla_device(device, type(self).__name__),
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register "single_xla"."""
        registry.register("single_xla", cls, description="One process on one XLA device (TPU core, or PJRT CPU).")
