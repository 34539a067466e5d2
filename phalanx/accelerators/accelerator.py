"""The Accelerator: everything that depends on the kind of device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from phalanx.utilities.registry import Registry


class Accelerator(ABC):
    """Base class for a kind of device (CPU, CUDA, MPS)."""

    name: str = ""
    #: Only strategies of this family (``Strategy.family``) run here; None: any strategy.
    strategy_family: ClassVar[str | None] = None
    #: The most processes a strategy may run on this kind of device; None: no limit.
    max_processes: ClassVar[int | None] = None
    #: Why ``max_processes`` is the limit, for the refusal (e.g. "one Apple GPU, no collective backend").
    max_processes_reason: ClassVar[str] = ""

    def setup_device(self, device: torch.device) -> None:
        """Prepare ``device`` for use by this process (e.g. make it the current CUDA device)."""

    def setup(self) -> None:
        """Called at the start of ``Strategy.setup``, before the model is moved (nothing to do by default)."""

    def teardown(self) -> None:
        """Release what ``setup_device`` acquired."""

    def get_device_stats(self, device: torch.device) -> dict[str, Any]:
        """Return device statistics (memory, utilisation) for monitoring callbacks."""
        return {}

    @staticmethod
    @abstractmethod
    def parse_devices(devices: Any) -> Any:
        """Validate the Trainer's ``devices`` argument and normalise it (a count or a list of indices)."""

    @staticmethod
    @abstractmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """Return the ``torch.device`` objects for the parsed ``devices``."""

    @staticmethod
    @abstractmethod
    def auto_device_count() -> int:
        """Return how many devices ``devices="auto"`` (or -1) means."""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Return whether this kind of device can be used on this machine."""

    @classmethod
    def unavailable_hint(cls) -> str:
        """Why this kind of device is unusable here and what to do about it (appended to the refusal; may be empty)."""
        return ""

    @classmethod
    def auto_strategy(cls, process_count: int) -> str:
        """The registered strategy name that ``strategy="auto"`` means for ``process_count`` processes."""
        return "ddp" if process_count > 1 else "single_device"

    @classmethod
    def supported_precisions(cls) -> tuple[str, ...]:
        """Return the precision names this kind of device can run."""
        return ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")

    @classmethod
    def register_accelerators(cls, registry: Registry[Accelerator]) -> None:
        """Register this accelerator under its names in ``registry``."""
