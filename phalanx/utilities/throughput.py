"""Throughput arithmetic: rates over a window of updates, FLOPs counted by torch, and the peak FLOPs of known devices.

:class:`Throughput` turns running totals (time, batches, samples, items, FLOPs) into rates over its last
``window_size`` updates, with Lightning's metric names (``lightning.fabric.utilities.throughput``);
:func:`measure_flops` counts a forward (and backward) pass with ``torch.utils.flop_counter``;
:func:`get_available_flops` is the peak of a CUDA device for a dtype, where this table knows it, for the MFU.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

#: Dense (no structured sparsity) peak FLOP/s per chip, from the vendors' datasheets; "tfloat32" is float32 on the
#: tensor cores (torch.get_float32_matmul_precision() other than "highest").
_CUDA_PEAKS: dict[str, dict[Any, float]] = {
    "h200": {torch.float64: 67e12, torch.float32: 67e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12,
             torch.float16: 989.4e12},
    "h100 sxm": {torch.float64: 67e12, torch.float32: 67e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12,
                 torch.float16: 989.4e12},
    "h100 pcie": {torch.float64: 51.2e12, torch.float32: 51.2e12, "tfloat32": 378e12, torch.bfloat16: 756e12,
                  torch.float16: 756e12},
    "a100": {torch.float64: 19.5e12, torch.float32: 19.5e12, "tfloat32": 156e12, torch.bfloat16: 312e12,
             torch.float16: 312e12},
    "l40s": {torch.float32: 91.6e12, "tfloat32": 183e12, torch.bfloat16: 362.05e12, torch.float16: 362.05e12},
    "l4": {torch.float32: 30.3e12, "tfloat32": 60e12, torch.bfloat16: 121e12, torch.float16: 121e12},
    "v100 sxm": {torch.float64: 7.8e12, torch.float32: 15.7e12, torch.float16: 125e12},
    "v100 pcie": {torch.float64: 7e12, torch.float32: 14e12, torch.float16: 112e12},
    "t4": {torch.float32: 8.1e12, torch.float16: 65e12},
}  # fmt: skip


def _chip(device_name: str) -> str | None:
    """The row of ``_CUDA_PEAKS`` for a CUDA device name (``torch.cuda.get_device_name``), or None."""
    name = device_name.lower()
    if "nvl" in name:
        return None  # the NVL boards (H100 NVL, H200 NVL) run at lower clocks than the SXM rows
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100 pcie" if "pcie" in name else "h100 sxm" if "hbm3" in name or "sxm" in name else None
    if "a100" in name:
        return "a100"
    if "l40s" in name:
        return "l40s"
    if "v100" in name:
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    for chip in ("l4", "t4"):
        if chip in name.replace("-", " ").split():
            return chip
    return None


def get_available_flops(device: torch.device, dtype: torch.dtype | None) -> float | None:
    """The peak FLOP/s of ``device`` for ``dtype`` (the denominator of the MFU), or None where it is not known:
    a device other than CUDA, a GPU missing from the table, or a dtype it has no peak for."""
    if device.type != "cuda" or dtype is None:
        return None
    chip = _chip(torch.cuda.get_device_name(device))
    if chip is None:
        return None
    peaks = _CUDA_PEAKS[chip]
    key: Any = dtype
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest" and "tfloat32" in peaks:
        key = "tfloat32"
    return peaks.get(key)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype the matmuls of a Trainer ``precision`` (``"bf16-mixed"``, ``"32-true"``...) run in, or None."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("32"):
        return torch.float32
    if precision.startswith("64"):
        return torch.float64
    return None


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """The FLOPs of ``forward_fn()`` (and of the backward of ``loss_fn(forward_fn())`` when given), counted by
    ``torch.utils.flop_counter.FlopCounterMode``. Build the model and inputs under ``torch.device("meta")`` to count
    without computing."""
    from torch.utils.flop_counter import FlopCounterMode  # loaded only by those who count

    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return int(counter.get_total_flops())


class _Increasing(deque):
    """A window of the last ``maxlen`` values of a running total, which must increase with every update."""

    def __init__(self, what: str, maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.what = what

    def append(self, value: Any) -> None:
        if self and value <= self[-1]:
            raise ValueError(
                f"Throughput.update: {self.what}={value} does not increase on the last update's {self[-1]}; pass"
                f" running totals, not per-batch values."
            )
        super().append(value)


class Throughput:
    """Rates over the last ``window_size`` updates of running totals, with Lightning's metric names.

    :meth:`compute` returns the totals (``time``, ``batches``, ``samples``, ``lengths``) and, once the window is
    full, ``device/batches_per_sec``, ``device/samples_per_sec``, ``device/items_per_sec`` (from ``lengths``),
    ``device/flops_per_sec`` and ``device/mfu`` (with ``available_flops``); with ``world_size`` > 1 also the world's
    ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec`` and ``flops_per_sec``, this device's rate times the
    world size (every device is taken to process as much).

    Args:
        available_flops: The peak FLOP/s of one device, for the MFU (None: no MFU).
        world_size: The number of devices.
        window_size: The updates the rates are computed over (at least 2).
        separator: Between ``device`` and a metric's name.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not valid; pass the number of devices, an int >= 1.")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(
                f"window_size={window_size!r} is not valid; pass an int >= 2 (rates are differences over the window)."
            )
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time = _Increasing("time", window_size)
        self._batches = _Increasing("batches", window_size)
        self._samples = _Increasing("samples", window_size)
        self._lengths = _Increasing("lengths", window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """Record the running totals after a batch: seconds, batches, samples and items (``lengths``) so far on this
        device, and the FLOPs of this device since the last update."""
        if samples < batches:
            raise ValueError(f"Throughput.update: samples={samples} is below batches={batches}; pass the sample count.")
        if lengths is not None and lengths < samples:
            raise ValueError(f"Throughput.update: lengths={lengths} is below samples={samples}; pass the item count.")
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> dict[str, float]:
        """The totals and the rates over the window (see the class)."""
        if not self._time:
            return {}
        device = f"device{self.separator}"
        world = self.world_size > 1
        metrics: dict[str, float] = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        full = len(self._time) == self._time.maxlen
        elapsed = self._time[-1] - self._time[0]
        rates = {"batches_per_sec": self._batches, "samples_per_sec": self._samples} if full else {}
        if len(self._lengths) == self._lengths.maxlen:
            rates["items_per_sec"] = self._lengths
        for name, window in rates.items():
            metrics[device + name] = (window[-1] - window[0]) / elapsed
            if world:
                metrics[name] = metrics[device + name] * self.world_size
        if len(self._flops) == self._flops.maxlen:
            # The FLOPs of the first update were spent before the window's first time: they are not counted.
            flops_per_sec = (sum(self._flops) - self._flops[0]) / elapsed
            if world:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[device + "flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                metrics[device + "mfu"] = metrics[device + "flops_per_sec"] / self.available_flops
        return metrics

    def reset(self) -> None:
        """Forget every update."""
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


__all__ = ["Throughput", "compute_dtype", "get_available_flops", "measure_flops"]
