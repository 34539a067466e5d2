"""The Trainer and its loops."""

from phalanx.trainer.preemption import PREEMPTED_EXIT_CODE, Preemption
from phalanx.trainer.trainer import Trainer

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption", "Trainer"]
