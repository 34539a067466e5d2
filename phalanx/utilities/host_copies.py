"""Numbers of device tensors for display, read without waiting for the device: a non-blocking copy into host memory
started at one read is what a later read shows, once the device has finished it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _Arrived:
    """A copy that is done when it returns (the CPU's; MPS's and XLA's, which wait), as an event would say it."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class _HostBuffer:
    """Host memory for the scalars of one device (pinned on CUDA), kept from read to read, with a NumPy view made once:
    reading the numbers is a plain memory read, and no read allocates pinned memory again."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        # A normal tensor even when first made inside inference mode (a validation's redraw): an inference tensor could
        # not be copied into at a later redraw outside it.
        with torch.inference_mode(False):
            self.tensor = torch.empty(size, dtype=self.dtype, pin_memory=device.type == "cuda")
        self.view = self.tensor.numpy()
        self.names: tuple[str, ...] = ()
        self.integers: tuple[bool, ...] = ()
        #: The event behind the copy last started into the buffer (None: no copy waits to be read).
        self.copy: Any = None

    def numbers(self) -> dict[str, int | float]:
        view = self.view
        return {
            name: int(view[index]) if integer else float(view[index])
            for index, (name, integer) in enumerate(zip(self.names, self.integers))
        }


def start_copy(host: Tensor, values: Tensor) -> Any:
    """Copy ``values`` into the host tensor ``host``; return what says whether the copy arrived (``query()``, and
    ``synchronize()`` to wait): a CUDA event recorded behind a non-blocking copy, or at once where the copy waits."""
    if values.device.type == "cuda":
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(values.device))
        return event
    host.copy_(values)  # the CPU copies at once; MPS and XLA have no event to ask without waiting, so the copy waits
    return _Arrived()


class HostCopies:
    """The scalar tensors of a metrics dictionary as Python numbers, without a host-device synchronisation.

    Each :meth:`read` starts a copy of the current values into host memory (non-blocking on CUDA, into pinned memory,
    with an event recorded behind it) and returns the newest values that have arrived: on the CPU those just copied;
    on CUDA usually those of the copy started at the previous read, so a progress bar shows a value one redraw late
    rather than making the training step wait. ``read(..., wait=True)`` waits for its copy (a stage's final display,
    once per epoch). Tensors of more than one element are shown as lists, which waits for the device; values that are
    not tensors pass through unchanged.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, _HostBuffer] = {}
        self._shown: dict[str, int | float] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Pinned buffers and their NumPy views do not travel (a pickled view would stop being one): a copy starts empty.
        return {"_buffers": {}, "_shown": {}}

    def read(self, metrics: dict[str, Any], wait: bool = False) -> dict[str, Any]:
        """``metrics`` with each scalar tensor replaced by the newest number that reached the host (a key whose first
        copy is still on its way is left out)."""
        result: dict[str, Any] = {}
        scalars: dict[torch.device, list[tuple[str, Tensor]]] = {}
        for key, value in metrics.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                result[key] = None  # keeps the order of the keys; filled in below
                scalars.setdefault(value.device, []).append((key, value))
            elif isinstance(value, Tensor):
                result[key] = str(value.tolist())
            else:
                result[key] = value
        for device, items in scalars.items():
            self._copy(device, items, wait)
        for key in [key for key, value in result.items() if value is None]:
            if key in self._shown:
                result[key] = self._shown[key]
            else:
                del result[key]
        return result

    def _collect(self, buffer: _HostBuffer, wait: bool) -> bool:
        """Take the numbers of the buffer's last copy if it arrived (or, with ``wait``, once it arrives); return
        whether the buffer is free for another copy."""
        if buffer.copy is None:
            return True
        if not buffer.copy.query():
            if not wait:
                return False
            buffer.copy.synchronize()
        self._shown.update(buffer.numbers())
        buffer.copy = None
        return True

    def _copy(self, device: torch.device, items: list[tuple[str, Tensor]], wait: bool) -> None:
        buffer = self._buffers.get(device)
        if buffer is not None and not self._collect(buffer, wait):
            return  # the device is behind: show what arrived, and copy again at a later read
        if buffer is None or buffer.tensor.numel() != len(items):
            buffer = self._buffers[device] = _HostBuffer(device, len(items))
        stacked = torch.stack([value.detach().reshape(()).to(buffer.dtype) for _, value in items])
        buffer.names = tuple(name for name, _ in items)
        buffer.integers = tuple(not (value.is_floating_point() or value.is_complex()) for _, value in items)
        buffer.copy = start_copy(buffer.tensor, stacked)
        self._collect(buffer, wait)


__all__ = ["HostCopies", "start_copy"]
