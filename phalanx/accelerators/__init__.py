"""Accelerators: the kinds of device phalanx can run on."""

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.cpu import CPUAccelerator
from phalanx.accelerators.cuda import CUDAAccelerator
from phalanx.accelerators.mps import MPSAccelerator
from phalanx.accelerators.registry import ACCELERATOR_REGISTRY
from phalanx.accelerators.xla import XLAAccelerator

__all__ = [
    "ACCELERATOR_REGISTRY",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "MPSAccelerator",
    "XLAAccelerator",
]
