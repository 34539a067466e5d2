"""Strategies: how training is distributed."""

from phalanx.strategies.registry import STRATEGY_REGISTRY
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy

__all__ = ["STRATEGY_REGISTRY", "SingleDeviceStrategy", "Strategy"]
