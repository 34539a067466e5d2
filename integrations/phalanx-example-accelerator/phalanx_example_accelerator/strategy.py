"""ExampleStrategy: one process on one device, with ExampleCPUAccelerator unless given another accelerator."""

from __future__ import annotations

from typing import Any

from torch import nn

from phalanx.strategies import RunSettings, SingleDeviceStrategy
from phalanx_example_accelerator.accelerator import ExampleCPUAccelerator


class ExampleStrategy(SingleDeviceStrategy):
    """A single-device strategy that brings its own accelerator and records the settings of each run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("accelerator") is None:
            kwargs["accelerator"] = ExampleCPUAccelerator()
        super().__init__(*args, **kwargs)
        self.settings: list[RunSettings] = []

    def prepare_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        """Keep the run's settings (what a real strategy would read its options from), then prepare as usual."""
        self.settings.append(settings)
        return super().prepare_module(module, settings)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register "example_single_device"."""
        registry.register(
            "example_single_device", cls, description="One device, with the example_cpu accelerator (example package)."
        )
