"""Plugins composed by strategies: precision, checkpoint IO, cluster environments."""

from typing import Any

from phalanx.plugins.environments import (
    ClusterEnvironment,
    DefaultEnvironment,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from phalanx.plugins.environments.xla import XLAEnvironment
from phalanx.plugins.io import NOT_OFFERED as _IO_NOT_OFFERED
from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from phalanx.plugins.precision import NOT_OFFERED as _PRECISION_NOT_OFFERED
from phalanx.plugins.precision import (
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    XLAPrecision,
)
from phalanx.utilities.lightning_names import missing_name_error

#: Lightning's plugins that phalanx does not have, with what to use instead.
NOT_OFFERED = {**_PRECISION_NOT_OFFERED, **_IO_NOT_OFFERED}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "DeepSpeedPrecision",
    "DefaultEnvironment",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LayerSync",
    "MPIEnvironment",
    "MixedPrecision",
    "Precision",
    "SLURMEnvironment",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
    "TorchSyncBatchNorm",
    "XLAEnvironment",
    "XLAPrecision",
]
