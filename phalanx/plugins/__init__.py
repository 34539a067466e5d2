"""Plugins composed by strategies: precision, checkpoint IO, cluster environments."""

from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "DoublePrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
]
