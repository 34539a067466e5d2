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
        self._detached: tuple[Tensor | None, Tensor | None] = (None, None)  # the last recorded loss, and its detach

    def record(self, loss: Tensor) -> None:
        """Add ``loss`` (any shape) into the sum on its device, without reading it."""
        if loss.requires_grad:
            self._detached = (loss, loss := loss.detach())
        if loss.ndim:
            loss = loss.sum()
        total = self._sum
        if total is None:
            # A float32 or float64 loss is summed in its own dtype: adding it then needs no conversion op per batch
            # (and only losses near the dtype's limit could make a finite window overflow). 16-bit losses get more
            # bits, where a long window of finite ones cannot overflow; MPS has no float64.
            if loss.dtype in (torch.float32, torch.float64):
                dtype = loss.dtype
            else:
                dtype = torch.float32 if loss.device.type == "mps" else torch.float64
            total = self._sum = torch.zeros((), dtype=dtype, device=loss.device)
        total.add_(loss)
        self.recorded += 1

    def detached(self, loss: Tensor) -> Tensor:
        """``loss.detach()``, reusing the detach that ``record`` made of this same loss: a driver that records the loss
        and keeps it detached pays one detach op per batch, not two."""
        recorded, detached = self._detached
        self._detached = (None, None)  # holds no graph past the batch
        return detached if recorded is loss and detached is not None else loss.detach()

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
