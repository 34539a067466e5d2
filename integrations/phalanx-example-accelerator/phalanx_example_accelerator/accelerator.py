"""ExampleCPUAccelerator: the CPU, counting what the strategy asks of it (a stand-in for a real device plugin)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.accelerators import CPUAccelerator


class ExampleCPUAccelerator(CPUAccelerator):
    """Runs on the CPU like ``"cpu"``, and counts device set-ups, set-ups and teardowns (reported as device stats)."""

    name = "example_cpu"

    def __init__(self) -> None:
        self.calls = {"setup_device": 0, "setup": 0, "teardown": 0}
        self.devices: list[torch.device] = []

    def setup_device(self, device: torch.device) -> None:
        """Record the device this process computes on (a real plugin would select or initialise it here)."""
        if device.type != "cpu":
            raise ValueError(f"ExampleCPUAccelerator runs on the CPU only, got device {device}.")
        self.calls["setup_device"] += 1
        self.devices.append(device)

    def setup(self) -> None:
        """Count the set-up of a run (called at the start of ``Strategy.setup``)."""
        self.calls["setup"] += 1

    def teardown(self) -> None:
        """Count the release of the device."""
        self.calls["teardown"] += 1

    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        """The counters, as a real accelerator would report memory or utilisation."""
        return {f"example_cpu/{name}": count for name, count in self.calls.items()}

    @classmethod
    def register_accelerators(cls, registry: Any) -> None:
        """Register as "example_cpu"."""
        registry.register("example_cpu", cls, description="The CPU, counting device set-ups (example package).")
