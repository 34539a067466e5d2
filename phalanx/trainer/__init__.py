"""The Trainer and its loops."""

from phalanx.trainer.trainer import Trainer

__all__ = ["Trainer"]
