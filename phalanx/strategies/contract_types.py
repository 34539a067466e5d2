"""The types the Strategy contract names in its signatures, gathered for annotations (import under TYPE_CHECKING)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Union

from torch.distributed import ProcessGroup

from phalanx.strategies.launchers.launcher import Launcher
from phalanx.utilities.registry import Registry

if TYPE_CHECKING:
    # Type-only: phalanx.module sits above the strategies and imports them.
    from phalanx.module import TrainingModule

#: A checkpoint path as the CheckpointIO takes it.
PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Launcher", "PathLike", "ProcessGroup", "Registry", "TrainingModule"]
