"""The tuner: Lightning's ``Tuner(trainer)`` with ``lr_find`` and ``scale_batch_size``."""

from phalanx.tuner.tuning import Tuner

__all__ = ["Tuner"]
