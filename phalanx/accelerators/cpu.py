"""The CPU accelerator."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.utilities.registry import Registry


def _parse_count(devices: Any, kind: str) -> int:
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            devices = int(text)
        else:
            raise ValueError(
                f"devices={devices!r} is not valid for the {kind} accelerator: pass a positive int or 'auto'."
            )
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(
            f"devices={devices!r} is not valid for the {kind} accelerator: "
            f"pass a positive int (number of processes) or 'auto'."
        )
    return devices


class CPUAccelerator(Accelerator):
    """Runs on the CPU; ``devices=N`` means N processes."""

    name = "cpu"

    @staticmethod
    def parse_devices(devices: Any) -> int:
        """Return the number of CPU processes for ``devices`` ('auto' and -1 mean 1)."""
        if devices == "auto":
            return 1
        count = _parse_count(devices, "cpu")
        if count == -1:
            return CPUAccelerator.auto_device_count()
        if count <= 0:
            raise ValueError(f"devices={devices!r} is not valid: the number of devices must be >= 1 (or -1/'auto').")
        return count

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """Return ``devices`` CPU devices, one per process."""
        return [torch.device("cpu")] * CPUAccelerator.parse_devices(devices)

    @staticmethod
    def auto_device_count() -> int:
        """One process on the CPU unless asked for more."""
        return 1

    @staticmethod
    def is_available() -> bool:
        """The CPU is always available."""
        return True

    @classmethod
    def register_accelerators(cls, registry: Registry[Accelerator]) -> None:
        """Register as "cpu"."""
        registry.register("cpu", cls, description="The CPU.")
