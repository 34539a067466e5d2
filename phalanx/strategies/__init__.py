"""Strategies: how training is distributed."""

from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.deepspeed import DeepSpeedStrategy
from phalanx.strategies.fault_tolerant import (
    DDPFaultTolerantStrategy,
    FaultTolerance,
    HSDPFaultTolerantStrategy,
    SemiSync,
    start_lighthouse,
)
from phalanx.strategies.fsdp import FSDPStrategy, ModelParallelStrategy
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.registry import STRATEGY_REGISTRY
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.strategies.xla import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLASPMDStrategy, XLAStrategy

__all__ = [
    "DDPFaultTolerantStrategy",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FaultTolerance",
    "FSDPStrategy",
    "HSDPFaultTolerantStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "RunSettings",
    "SemiSync",
    "STRATEGY_REGISTRY",
    "SingleDeviceStrategy",
    "SingleDeviceXLAStrategy",
    "Strategy",
    "StrategyTraits",
    "XLAFSDPStrategy",
    "XLASPMDStrategy",
    "XLAStrategy",
    "start_lighthouse",
]
