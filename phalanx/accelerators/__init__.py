"""Accelerators: the kinds of device phalanx can run on."""

from typing import Any

from phalanx.accelerators.accelerator import Accelerator
from phalanx.accelerators.cpu import CPUAccelerator
from phalanx.accelerators.cuda import CUDAAccelerator
from phalanx.accelerators.mps import MPSAccelerator
from phalanx.accelerators.registry import ACCELERATOR_REGISTRY
from phalanx.accelerators.xla import XLAAccelerator
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's accelerator helpers that phalanx does not have, with what to use instead.
NOT_OFFERED = {
    "find_usable_cuda_devices": NotOffered(
        "Trainer(devices=N), which takes the first N GPUs that CUDA_VISIBLE_DEVICES leaves visible"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "ACCELERATOR_REGISTRY",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "MPSAccelerator",
    "XLAAccelerator",
]
