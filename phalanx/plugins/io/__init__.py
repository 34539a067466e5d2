"""Checkpoint IO plugins."""

from phalanx.plugins.io.async_io import AsyncCheckpointIO
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.collectives import Collectives
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.torch_io import TorchCheckpointIO

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "Collectives", "TorchCheckpointIO", "checkpoint_layout"]
