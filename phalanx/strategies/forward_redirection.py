"""Run a TrainingModule's step method through the forward of the wrapper around it."""

from __future__ import annotations

from typing import Any

from torch import nn


def redirect_forward(wrapper: nn.Module, module: nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``module.<method_name>(*args, **kwargs)`` by way of ``wrapper(...)``.

    Wrappers such as DistributedDataParallel or FSDP do their work in hooks around ``forward``; calling
    ``training_step`` directly would bypass them. The module's ``forward`` is swapped for the step method for the
    duration of one call, and the wrapper is called as usual.
    """
    original_forward = module.forward
    method = getattr(module, method_name)

    def step_as_forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        # Restore first, so that a forward() called inside the step method is the real one.
        module.forward = original_forward  # type: ignore[method-assign]
        return method(*inner_args, **inner_kwargs)

    module.forward = step_as_forward  # type: ignore[method-assign]
    try:
        return wrapper(*args, **kwargs)
    finally:
        if "forward" in module.__dict__:
            del module.__dict__["forward"]
