"""The CUDA accelerator."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.cpu import _parse_count
from phalanx.utilities.registry import Registry


def parse_gpu_ids(devices: Any, available: int, kind: str) -> list[int]:
    """Turn ``devices`` (int, -1, 'auto', list of ints, '0,1') into a list of device indices, checking the range."""
    if devices == "auto":
        devices = -1
    if isinstance(devices, str) and "," in devices:
        try:
            devices = [int(part) for part in devices.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"devices={devices!r} is not a comma-separated list of {kind} indices.") from None
    if isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
            raise ValueError(f"devices={devices!r}: a list of devices must be a non-empty list of {kind} indices.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices={devices!r} names a device more than once.")
        bad = [i for i in devices if not 0 <= i < available]
        if bad:
            raise ValueError(
                f"devices={devices!r} asks for {kind} index {bad[0]}, but this machine has {available} {kind}"
                f" device(s): valid indices are {list(range(available))}."
            )
        return list(devices)
    count = _parse_count(devices, kind)
    if count == -1:
        count = available
    if count <= 0:
        raise ValueError(f"devices={devices!r} is not valid: ask for at least one {kind} device (or -1/'auto').")
    if count > available:
        raise ValueError(f"devices={count} asks for {count} {kind} devices, but this machine has {available}.")
    return list(range(count))


class CUDAAccelerator(Accelerator):
    """Runs on NVIDIA GPUs through CUDA; ``devices`` selects GPU indices."""

    name = "cuda"

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` the current CUDA device."""
        if device.type != "cuda":
            raise ValueError(f"CUDAAccelerator got a non-CUDA device: {device}")
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        """Return cached memory to the driver."""
        torch.cuda.empty_cache()

    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        """Return ``torch.cuda.memory_stats`` for ``device``."""
        return torch.cuda.memory_stats(device)

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """Return the list of GPU indices for ``devices``."""
        return parse_gpu_ids(devices, CUDAAccelerator.auto_device_count(), "cuda")

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """Return one ``cuda:i`` device per index."""
        return [torch.device("cuda", i) for i in CUDAAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        """Return the number of visible GPUs."""
        return torch.cuda.device_count()

    @staticmethod
    def is_available() -> bool:
        """Return whether a CUDA device can be used."""
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    @classmethod
    def supported_precisions(cls) -> tuple[str, ...]:
        """bf16 needs hardware support (Ampere or newer)."""
        precisions: tuple[str, ...] = ("32-true", "64-true", "16-mixed", "16-true")
        if cls.is_available() and torch.cuda.is_bf16_supported():
            precisions += ("bf16-mixed", "bf16-true")
        return precisions

    @classmethod
    def register_accelerators(cls, registry: Registry[Accelerator]) -> None:
        """Register as "cuda" ("gpu" is resolved to cuda or mps by the Trainer)."""
        registry.register("cuda", cls, description="NVIDIA GPUs through CUDA.")
