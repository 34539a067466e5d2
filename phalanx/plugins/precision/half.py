"""Whole-model half precision: parameters, inputs and computation in float16 or bfloat16."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator

import torch

from phalanx.plugins.precision.precision import ModuleT, Precision
from phalanx.utilities.apply import apply_to_tensors


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Set torch's default floating dtype for the duration of the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors in ``data`` to ``dtype``."""
    return apply_to_tensors(data, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)


class TruePrecision(Precision):
    """Base for precisions that run the whole model in one dtype."""

    dtype: torch.dtype = torch.float32

    def convert_module(self, module: ModuleT) -> ModuleT:
        """Cast floating-point parameters and buffers (complex and integer ones keep their dtype)."""
        # module.to(dtype=...) would also turn complex tensors into real ones, dropping their imaginary part.
        return module._apply(lambda tensor: tensor.to(self.dtype) if tensor.is_floating_point() else tensor)

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs."""
        return cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs back to torch's default dtype, so that a loss computed on them is in it."""
        return cast_floating(data, torch.get_default_dtype())

    @property
    def converts_io(self) -> bool:
        """Inputs and outputs change dtype."""
        return True

    def tensor_init_context(self) -> AbstractContextManager:
        """New floating tensors default to this dtype."""
        return default_dtype(self.dtype)

    def forward_context(self) -> AbstractContextManager:
        """Tensors created inside a step default to this dtype."""
        return default_dtype(self.dtype)


class HalfPrecision(TruePrecision):
    """'16-true' (float16) or 'bf16-true' (bfloat16) for everything: least memory, least numerical headroom."""

    def __init__(self, precision: str = "bf16-true") -> None:
        if precision not in ("16-true", "bf16-true"):
            raise ValueError(f"HalfPrecision supports '16-true' and 'bf16-true', got precision={precision!r}.")
        self.precision = precision
        self.dtype = torch.float16 if precision == "16-true" else torch.bfloat16
