"""Precision plugins."""

from phalanx.plugins.precision.amp import MixedPrecision
from phalanx.plugins.precision.double import DoublePrecision
from phalanx.plugins.precision.half import HalfPrecision
from phalanx.plugins.precision.precision import Precision

__all__ = ["DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]
