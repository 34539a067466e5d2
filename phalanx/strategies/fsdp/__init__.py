"""The FSDP family: FSDP2 (``fully_shard``) and DTensor model-parallel strategies."""

from phalanx.strategies.fsdp.model_parallel import ModelParallelStrategy
from phalanx.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy", "ModelParallelStrategy"]
