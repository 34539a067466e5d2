"""The DeepSpeed family: ``DeepSpeedStrategy`` and its private collaborators (config, engine, checkpoints, ZeRO-3)."""

from phalanx.strategies.deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedStrategy"]
