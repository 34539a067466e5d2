"""Mixed precision with torch.autocast, and loss scaling for float16 on CUDA."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from phalanx.plugins.precision.half import cast_floating
from phalanx.plugins.precision.precision import BeforeStep, Precision


class MixedPrecision(Precision):
    """Runs forward passes under ``torch.autocast``; float16 on CUDA also scales the loss with a GradScaler."""

    def __init__(
        self, precision: str = "bf16-mixed", device: str = "cuda", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"MixedPrecision supports '16-mixed' and 'bf16-mixed', got precision={precision!r}.")
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError("A GradScaler is only useful with '16-mixed'; bfloat16 has float32's range.")
        self.precision = precision
        self.device = device
        self.dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        if scaler is None and precision == "16-mixed" and device == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        self.scaler = scaler
        # GradScaler refuses a second unscale_() of one optimizer before update(): remember which were unscaled.
        self._unscaled: set[int] = set()

    def autocast_context_manager(self) -> torch.autocast:
        """A new ``torch.autocast`` to the mixed dtype on this device (Lightning's name; override it to change how
        forward passes autocast).

        Its weight-cast cache is off, as in Lightning: the cache would keep the casts of weights that an optimizer step
        inside the same step (manual optimization, e.g. a GAN's two optimizers) has updated since.
        """
        return torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)

    def forward_context(self) -> AbstractContextManager:
        """Autocast to the mixed dtype on this device: :meth:`autocast_context_manager`."""
        return self.autocast_context_manager()

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs (autocast's half dtype) back to torch's default dtype.

        Inputs are left as they are (``convert_input`` is the base's): autocast casts them for the operations that
        run in the half dtype and keeps float32 for the others, as the Trainer does.
        """
        return cast_floating(data, torch.get_default_dtype())

    @property
    def converts_io(self) -> bool:
        """Outputs change dtype (autocast computes in the half dtype)."""
        return True

    def pre_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        """Scale the loss when a GradScaler is used."""
        if self.scaler is not None:
            return self.scaler.scale(tensor)
        return tensor

    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: nn.Module | None,
        closure: Callable[[], Any],
        *,
        before_step: BeforeStep | None = None,
        **kwargs: Any,
    ) -> Any:
        """Without a scaler, as the base; with one, run the closure, unscale, ``before_step``, then ``scaler.step``."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model, closure, before_step=before_step, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                "LBFGS needs its closure re-evaluated, which a GradScaler cannot do: use '32-true' or 'bf16-mixed'."
            )
        closure_result = closure()
        skipped = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skipped:
            self.unscale_gradients(optimizer)  # before the hooks and clipping in _after_closure see the gradients
        self._after_closure(optimizer, before_step)
        if skipped:
            # training_step returned None: there are no gradients to step on. Clipping in the hooks may still have
            # unscaled this optimizer; without update() the scaler would refuse to unscale it next step.
            if id(optimizer) in self._unscaled:
                self._unscaled.discard(id(optimizer))
                self.scaler._per_optimizer_states.pop(id(optimizer), None)
            return None
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.clear()  # update() resets the scaler's per-optimizer state
        return result

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients at most once per step so hooks and clipping see true values."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: float | int, gradient_clip_algorithm: str = "norm"
    ) -> Tensor | None:
        """Unscale first, so that the threshold applies to the true gradients, then clip as the base does."""
        self._check_clip_algorithm(gradient_clip_algorithm)
        if clip_val > 0:
            self.unscale_gradients(optimizer)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the GradScaler's state."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
