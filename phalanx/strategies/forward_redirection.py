"""How a strategy runs a TrainingModule's step method: through the forward of the wrapper around it, and (evaluation
steps) in a grad mode the strategy allows."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
from torch import nn

_ABSENT = object()


def redirect_forward(
    wrapper: nn.Module,
    module: nn.Module,
    method_name: str,
    *args: Any,
    after_step: Callable[[], None] | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``module.<method_name>(*args, **kwargs)`` by way of ``wrapper(...)``.

    Wrappers such as DistributedDataParallel or FSDP do their work in hooks around ``forward``; calling
    ``training_step`` directly would bypass them. The module's ``forward`` is swapped for the step method for the
    duration of one call, and the wrapper is called as usual. ``after_step`` runs right after the step method,
    still inside the wrapper's forward.
    """
    # Work on __dict__ directly: nn.Module.__setattr__ would cost microseconds on every step.
    attributes = module.__dict__
    own_forward = attributes.get("forward", _ABSENT)
    method = getattr(module, method_name)

    def restore() -> None:
        if own_forward is _ABSENT:
            attributes.pop("forward", None)
        else:
            attributes["forward"] = own_forward

    def step_as_forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()  # first, so that a forward() called inside the step method is the real one
        result = method(*inner_args, **inner_kwargs)
        if after_step is not None:
            after_step()  # still inside the wrapper's forward, before its post-forward logic
        return result

    attributes["forward"] = step_as_forward
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()


def evaluation_grad_mode(strategy: Any) -> AbstractContextManager:
    """``no_grad`` in place of the caller's inference mode where ``strategy.traits.allows_inference_mode`` is False.

    The Trainer's loops ask the strategy before they enter inference mode; this covers other callers of the evaluation
    steps (a Cohort loop's ``validation_step`` under ``torch.inference_mode()``).
    """
    if torch.is_inference_mode_enabled() and not strategy.traits.allows_inference_mode:
        return _no_grad_outside_inference_mode()
    return nullcontext()


@contextmanager
def _no_grad_outside_inference_mode() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():
        yield
