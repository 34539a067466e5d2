"""A running sum of training losses on their device, read only where a loop reads values anyway (Trainer, Cohort)."""

from __future__ import annotations

import torch
from torch import Tensor


class LossFinitenessSum:
    """Tells whether any recorded loss was NaN or infinite, at no host sync and, per loss, no device operation.

    A NaN or an infinity in any term makes the sum non-finite, so one read of the sum answers for the whole window;
    counting each one would cost a second kernel per batch. The losses are kept (detached scalars) and summed
    ``FOLD_EVERY`` at a time: one stack and one sum per fold instead of an addition per loss, which on a small model
    costs as much as a Python layer of the step.
    """

    #: Losses kept before they are folded into the running sum (bounds what a window holds on the device).
    FOLD_EVERY = 64

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self._pending: list[Tensor] = []  # detached losses not yet in the sum
        self.recorded = 0  # losses recorded since the last read
        self._detached: tuple[Tensor | None, Tensor | None] = (None, None)  # the last recorded loss, and its detach

    def record(self, loss: Tensor) -> None:
        """Keep ``loss`` (any shape) for the sum on its device, without reading it."""
        if loss.requires_grad:
            self._detached = (loss, loss := loss.detach())
        pending = self._pending
        pending.append(loss.sum() if loss.ndim else loss)
        self.recorded += 1
        if len(pending) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            # A read can come inside inference mode (a checkpoint saved at validation's end): the sum made or updated
            # there must stay a normal tensor, which later folds may update in place.
            with torch.inference_mode(False):
                self._add(pending)

    def _add(self, pending: list[Tensor]) -> None:
        total = self._sum
        if total is None:
            # A float32 or float64 loss is summed in its own dtype (no conversion op; only losses near the dtype's
            # limit could make a finite window overflow). 16-bit losses get more bits, where a long window of finite
            # ones cannot overflow; MPS has no float64.
            first = pending[0]
            if first.dtype in (torch.float32, torch.float64):
                dtype = first.dtype
            else:
                dtype = torch.float32 if first.device.type == "mps" else torch.float64
            total = self._sum = torch.zeros((), dtype=dtype, device=first.device)
        # sum(dtype=) converts before adding: 16-bit losses cannot overflow in their own dtype on the way.
        total.add_(pending[0] if len(pending) == 1 else torch.stack(pending).sum(dtype=total.dtype))

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
        if self.recorded == 0:
            return None
        self._fold()
        total = self._sum
        if total is None:  # not reached: a fold of the recorded losses made it
            return None
        finite = bool(torch.isfinite(total))
        total.zero_()
        self.recorded = 0
        return finite
