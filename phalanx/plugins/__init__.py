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
from phalanx.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from phalanx.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning Fabric's precision plugins that phalanx will not offer, with what to use instead (``from phalanx.plugins
#: import BitsandbytesPrecision`` raises an ImportError saying so; so does passing Lightning's in ``plugins=``).
NOT_OFFERED = {
    "BitsandbytesPrecision": NotOffered(
        "bitsandbytes' quantised layers in your module (bnb.nn.Linear4bit, Linear8bitLt in place of nn.Linear, before"
        " setup) with precision='bf16-true' or '16-true'"
    ),
    "TransformerEnginePrecision": NotOffered(
        "Transformer Engine's layers in your module (te.Linear under te.fp8_autocast in forward) with"
        " precision='bf16-mixed' or 'bf16-true'"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


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
