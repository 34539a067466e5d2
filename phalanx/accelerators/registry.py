"""The accelerator registry: names -> Accelerator classes (third parties: entry-point group `phalanx.accelerators`)."""

from __future__ import annotations

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.cpu import CPUAccelerator
from phalanx.accelerators.cuda import CUDAAccelerator
from phalanx.accelerators.mps import MPSAccelerator
from phalanx.accelerators.xla import XLAAccelerator
from phalanx.utilities.registry import Registry

ACCELERATOR_REGISTRY: Registry[Accelerator] = Registry("accelerator", "phalanx.accelerators")

for _accelerator in (CPUAccelerator, CUDAAccelerator, MPSAccelerator, XLAAccelerator):
    _accelerator.register_accelerators(ACCELERATOR_REGISTRY)
