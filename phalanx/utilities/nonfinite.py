"""A running sum of training losses on their device, read only where a loop reads values anyway (Trainer, Cohort)."""

from __future__ import annotations

import torch
from torch import Tensor


class LossFinitenessSum:
    """Tells whether any recorded loss was NaN or infinite, at one device-side addition per loss and no host sync.

    A NaN or an infinity in any term makes the sum non-finite, so one read of the sum answers for the whole window;
    counting each one would cost a second kernel per batch.
    """

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self.recorded = 0  # losses recorded since the last read

    def record(self, loss: Tensor) -> None:
        """Add ``loss`` (any shape) into the sum on its device, without reading it."""
        if self._sum is None:
            dtype = torch.float32 if loss.device.type == "mps" else torch.float64  # MPS has no float64
            self._sum = torch.zeros((), dtype=dtype, device=loss.device)
        self._sum.add_(loss.detach().sum() if loss.ndim else loss.detach())
        self.recorded += 1

    def read(self) -> bool | None:
        """Read the sum on the host (a sync: call it where the loop syncs anyway) and start a new window.

        Returns None when nothing was recorded since the last read, else whether every loss was finite.
        """
        if self._sum is None or self.recorded == 0:
            return None
        finite = bool(torch.isfinite(self._sum))
        self._sum.zero_()
        self.recorded = 0
        return finite
