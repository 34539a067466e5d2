"""Precision on XLA devices: float32, bfloat16 weights ('bf16-true') or bfloat16 autocast ('bf16-mixed')."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from phalanx.accelerators.xla import XLA_PRECISIONS
from phalanx.plugins.precision.half import cast_floating
from phalanx.plugins.precision.precision import ModuleT, Precision


class XLAPrecision(Precision):
    """The precision plugin of the XLA strategies.

    'bf16-true' casts the floating parameters, buffers and inputs to bfloat16 without changing torch's default dtype:
    that default is one value for the whole process, and on the PJRT CPU runtime several device threads share a
    process (tensors a step creates itself, e.g. ``torch.zeros(n)``, stay float32 unless given a dtype).
    'bf16-mixed' runs forward passes under ``torch.autocast("xla", dtype=torch.bfloat16)`` (autocast is per thread).
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in XLA_PRECISIONS:
            raise ValueError(
                f"XLAPrecision(precision={precision!r}) is not supported on XLA devices; choose one of"
                f" {list(XLA_PRECISIONS)}."
            )
        self.precision = precision
        self.dtype = torch.float32 if precision == "32-true" else torch.bfloat16

    def convert_module(self, module: ModuleT) -> ModuleT:
        """'bf16-true': cast floating parameters and buffers to bfloat16 (others keep their dtype)."""
        if self.precision != "bf16-true":
            return module
        return module._apply(lambda tensor: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)

    def convert_input(self, data: Any) -> Any:
        """'bf16-true': cast floating inputs to bfloat16."""
        return cast_floating(data, torch.bfloat16) if self.precision == "bf16-true" else data

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs back to torch's default dtype (except for '32-true')."""
        return data if self.precision == "32-true" else cast_floating(data, torch.get_default_dtype())

    @property
    def converts_io(self) -> bool:
        """Everything but '32-true' changes dtypes."""
        return self.precision != "32-true"

    def forward_context(self) -> AbstractContextManager:
        """'bf16-mixed': bfloat16 autocast on the XLA device."""
        if self.precision == "bf16-mixed":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return nullcontext()


__all__ = ["XLA_PRECISIONS", "XLAPrecision"]
