"""Checkpoint IO plugins."""

from typing import Any

from phalanx.plugins.io.async_io import AsyncCheckpointIO
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's checkpoint IO plugins that phalanx does not have, with what to use instead.
NOT_OFFERED = {
    "XLACheckpointIO": NotOffered(
        "TorchCheckpointIO, which the XLA strategies use (they move tensors to the CPU first)"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = ["AsyncCheckpointIO", "CheckpointIO", "Collectives", "TorchCheckpointIO", "checkpoint_layout"]
