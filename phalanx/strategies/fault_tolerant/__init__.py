"""Fault-tolerant strategies on torchft: replica groups that keep training when one of them dies."""

from phalanx.strategies.fault_tolerant.ddp import DDPFaultTolerantStrategy
from phalanx.strategies.fault_tolerant.hsdp import HSDPFaultTolerantStrategy
from phalanx.strategies.fault_tolerant.lighthouse import Lighthouse, start_lighthouse
from phalanx.strategies.fault_tolerant.options import FaultTolerance
from phalanx.strategies.fault_tolerant.semi_sync import SemiSync

__all__ = [
    "DDPFaultTolerantStrategy",
    "HSDPFaultTolerantStrategy",
    "FaultTolerance",
    "Lighthouse",
    "SemiSync",
    "start_lighthouse",
]
