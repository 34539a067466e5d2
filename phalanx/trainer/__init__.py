"""The Trainer and its loops."""

from phalanx.trainer.preemption import PREEMPTED_EXIT_CODE, Preemption
from phalanx.trainer.trainer import Trainer
from phalanx.utilities.seed import seed_everything

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption", "Trainer", "seed_everything"]
