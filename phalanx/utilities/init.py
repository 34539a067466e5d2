"""Creating modules without paying for parameter initialisation."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any

from torch.overrides import TorchFunctionMode

# The in-place random fills that torch.nn.init functions end in.
_RANDOM_FILLS = frozenset(
    {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_"}
)
# Frames of torch's own dispatch machinery between an initialiser and this mode.
_DISPATCH_MODULES = ("torch.overrides", "torch._tensor")


def _called_from_torch_nn_init() -> bool:
    """Return whether the nearest caller outside torch's dispatch code is a ``torch.nn.init`` function."""
    frame = sys._getframe(2)  # skip this function and __torch_function__
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_DISPATCH_MODULES):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "torch.nn.init"


class _SkipInit(TorchFunctionMode):
    """Turns the in-place initialisers of ``torch.nn.init`` into no-ops (the values are overwritten later)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_"):
            return kwargs.get("tensor", args[0] if args else None)
        # Only some initialisers (uniform_, normal_, constant_, kaiming_uniform_) dispatch here themselves; others
        # (xavier_uniform_, trunc_normal_, orthogonal_, kaiming_normal_, ...) only show up as the random fills they
        # call, such as Tensor.uniform_: skip those too, or building the module still consumes the global RNG.
        if name in _RANDOM_FILLS and _called_from_torch_nn_init():
            return args[0] if args else kwargs.get("self")
        return func(*args, **kwargs)


def empty_init_context(enabled: bool = True) -> Any:
    """Context in which module constructors leave parameters uninitialised (memory allocated, values arbitrary)."""
    return _SkipInit() if enabled else nullcontext()
