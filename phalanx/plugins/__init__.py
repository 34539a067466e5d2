"""Plugins composed by strategies: precision, checkpoint IO, cluster environments."""

from phalanx.plugins.environments import (
    ClusterEnvironment,
    DefaultEnvironment,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "DefaultEnvironment",
    "DoublePrecision",
    "HalfPrecision",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "MixedPrecision",
    "Precision",
    "SLURMEnvironment",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
]
