"""Creating modules without paying for parameter initialisation."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    """Turns the in-place initialisers of ``torch.nn.init`` into no-ops (the values are overwritten later)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            return kwargs.get("tensor", args[0] if args else None)
        return func(*args, **kwargs)


def empty_init_context(enabled: bool = True) -> Any:
    """Context in which module constructors leave parameters uninitialised (memory allocated, values arbitrary)."""
    return _SkipInit() if enabled else nullcontext()

