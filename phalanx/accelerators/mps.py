"""The Apple MPS accelerator."""

from __future__ import annotations

import platform
from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.cuda import parse_gpu_ids
from phalanx.utilities.registry import Registry


class MPSAccelerator(Accelerator):
    """Runs on Apple silicon GPUs through Metal (one device)."""

    name = "mps"
    max_processes = 1
    max_processes_reason = "one Apple GPU, no collective backend"

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """Return ``[0]``: MPS has exactly one device."""
        return parse_gpu_ids(devices, MPSAccelerator.auto_device_count(), "mps")

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """Return the MPS device(s)."""
        return [torch.device("mps", i) for i in MPSAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        """One device when MPS is available."""
        return 1 if MPSAccelerator.is_available() else 0

    @staticmethod
    def is_available() -> bool:
        """Return whether MPS can be used (Apple silicon, macOS, a torch build with MPS)."""
        return platform.system() == "Darwin" and torch.backends.mps.is_available()

    @classmethod
    def supported_precisions(cls) -> tuple[str, ...]:
        """MPS has no float64."""
        return ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")

    @classmethod
    def register_accelerators(cls, registry: Registry[Accelerator]) -> None:
        """Register as "mps"."""
        registry.register("mps", cls, description="Apple silicon GPUs through Metal.")
