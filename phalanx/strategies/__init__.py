"""Strategies: how training is distributed."""

from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.strategies.registry import STRATEGY_REGISTRY
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy

__all__ = ["DDPStrategy", "ParallelStrategy", "STRATEGY_REGISTRY", "SingleDeviceStrategy", "Strategy"]
