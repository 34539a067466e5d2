"""Refusing ``loss.backward()`` where it trains differently from ``cohort.backward(loss)``.

On most strategies the two are the same computation (single device, DDP and FSDP in 32-bit: their gradient hooks run
either way), so the Cohort adds nothing there. Where ``cohort.backward`` does more than autograd, a plain
``loss.backward()`` trains silently wrong: DeepSpeed's engine scales the loss for accumulation and reduces the last
gradient bucket in its own backward, and a GradScaler (``16-mixed``) scales the loss that its step later unscales.
There the set-up module's outputs carry a tensor hook that refuses gradients arriving outside ``cohort.backward``.
It fires before any gradient reaches a parameter, so a refused backward leaves the gradients as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Iterator

from torch import Tensor

from phalanx.strategies.strategy import Strategy

_BACKWARD_STEPS = ("pre_backward", "backward", "post_backward")


def slip_reason(strategy: Any) -> str | None:
    """Why ``loss.backward()`` would train differently from ``cohort.backward(loss)`` on ``strategy``; None where it
    is harmless."""
    if type(strategy).backward is not Strategy.backward:
        return f"{type(strategy).__name__} runs backward through its own engine (loss scaling, gradient reduction)"
    precision = strategy.precision_plugin
    if getattr(precision, "scaler", None) is not None:
        return f"the {precision.precision!r} precision scales the loss with a GradScaler"
    # phalanx's own plugins change backward only through a GradScaler; a plugin of yours may do anything there.
    custom = [name for name in _BACKWARD_STEPS if not getattr(type(precision), name).__module__.startswith("phalanx.")]
    if custom:
        return f"the {type(precision).__name__} precision plugin has its own {custom[0]}"
    return None


class BackwardGuard:
    """Hooks the module's outputs; their gradients must arrive inside :meth:`allowed` (``cohort.backward``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        # A plain attribute, not a thread-local: autograd runs CUDA backward passes on its own worker threads.
        self._inside = False

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """The backward pass of ``cohort.backward`` runs inside."""
        previous, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = previous

    def watch(self, output: Any) -> Any:
        """Hook every tensor of ``output`` that has a gradient to come; returns ``output`` unchanged."""
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._check)
        return output

    def _check(self, grad: Tensor) -> None:
        if not self._inside:
            raise RuntimeError(
                f"A backward pass through the Cohort's module ran outside cohort.backward, but {self.reason}: "
                "loss.backward() would train differently here (no error, other weights). "
                "Call cohort.backward(loss) instead of loss.backward(). "
                "(torch.autograd.grad through the module's outputs is refused on this strategy for the same reason.)"
            )


def _tensors(data: Any) -> Iterator[Tensor]:
    if isinstance(data, Tensor):
        yield data
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from _tensors(item)
    elif isinstance(data, Mapping):
        for item in data.values():
            yield from _tensors(item)
