"""Precision plugins."""

from phalanx.plugins.precision.amp import MixedPrecision
from phalanx.plugins.precision.deepspeed import DeepSpeedPrecision
from phalanx.plugins.precision.double import DoublePrecision
from phalanx.plugins.precision.fsdp import FSDPPrecision
from phalanx.plugins.precision.half import HalfPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.plugins.precision.xla import XLAPrecision

__all__ = [
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "XLAPrecision",
]
