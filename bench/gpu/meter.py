"""Step timing over a window that leaves out warm-up and saves, and host-device synchronisations from the profiler."""

from __future__ import annotations

import time
from typing import Any

import torch

#: Peak dense bfloat16 tensor throughput by card name (flop/s); a card not listed has no MFU.
PEAK_BF16_FLOPS = {"H100 PCIe": None, "H100 NVL": None, "H100": 989e12, "H200": 989e12}
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def peak_flops(card: str) -> float | None:
    """The peak from :data:`PEAK_BF16_FLOPS` for the first (most specific) name that ``card`` contains."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in card:
            return flops
    return None


def card_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class Meter:
    """Called at the start and end of every step: times steps ``[warmup, warmup + steps)`` with one synchronisation
    at each edge of the window only, then profiles the next ``profile_steps`` steps and counts synchronisations."""

    def __init__(self, device: torch.device, warmup: int, steps: int, profile_steps: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.warmup, self.steps, self.profile_steps = warmup, steps, profile_steps
        self.began = self.seconds = 0.0
        self.profiler: Any = None
        self.counts: dict[str, float] = {}

    @property
    def total_steps(self) -> int:
        """Steps a run takes: warm-up, the timed window, the profiled steps and one more, so no window ends the run."""
        return self.warmup + self.steps + self.profile_steps + 1

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def step_start(self, index: int) -> None:
        if index == 0 and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if index == self.warmup:
            self._synchronize()
            self.began = time.perf_counter()
        elif index == self.warmup + self.steps and self.profile_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def step_end(self, index: int) -> None:
        if index == self.warmup + self.steps - 1:
            self._synchronize()
            self.seconds = time.perf_counter() - self.began
        elif index == self.warmup + self.steps + self.profile_steps - 1 and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.counts = self._count(self.profiler)
            self.profiler = None

    def _count(self, profiler: Any) -> dict[str, float]:
        names = [event.name for event in profiler.events()]
        per_step = float(self.profile_steps)
        return {
            "syncs_per_step": sum(name in SYNC_EVENTS for name in names) / per_step,
            "dtoh_copies_per_step": sum("Memcpy DtoH" in name for name in names) / per_step,
            "item_calls_per_step": sum(name == "aten::_local_scalar_dense" for name in names) / per_step,
        }

    def figures(self, tokens_per_step: int, parameters: int, devices: int = 1) -> dict[str, Any]:
        """ms per step, tokens/s (all devices), MFU (6 N tokens / time / (devices x peak)), this device's peak memory
        and the profiler's counts."""
        if not self.seconds:
            raise RuntimeError(f"the timed window did not close: the run took fewer than {self.total_steps} steps.")
        ms = 1000.0 * self.seconds / self.steps
        tokens_per_s = tokens_per_step * self.steps / self.seconds
        peak = peak_flops(card_name(self.device))
        memory = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        return {
            "ms_per_step": round(ms, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": round(6 * parameters * tokens_per_s / (peak * devices), 4) if peak else None,
            "peak_memory_gib": round(memory / 2**30, 3) if memory is not None else None,
            **self.counts,
        }
