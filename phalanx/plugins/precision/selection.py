"""Choosing the precision plugin for a precision name on an accelerator (for strategies and whoever builds them)."""

from __future__ import annotations

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.precision.amp import MixedPrecision
from phalanx.plugins.precision.double import DoublePrecision
from phalanx.plugins.precision.half import HalfPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.utilities.rank_zero import rank_zero_warn


def precision_plugin_for(precision: str, accelerator: Accelerator) -> Precision:
    """Return the precision plugin for ``precision`` on ``accelerator``, refusing what the device cannot run."""
    device_type = getattr(accelerator, "name", "") or "cpu"
    if precision == "16-mixed" and device_type == "cpu":
        rank_zero_warn(
            "precision='16-mixed' is not supported on the CPU: using 'bf16-mixed' (bfloat16 autocast) instead."
        )
        precision = "bf16-mixed"
    supported = type(accelerator).supported_precisions()
    if precision not in supported:
        raise ValueError(
            f"precision={precision!r} cannot run on the {device_type} accelerator here. Supported: {list(supported)}."
        )
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)
    return MixedPrecision(precision, device=device_type)


__all__ = ["precision_plugin_for"]
