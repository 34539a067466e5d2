"""Moved to :mod:`phalanx.optimization` (strategies use it too, and never import the Trainer's package)."""

from phalanx.optimization import LRSchedulerConfig, init_optimizers_and_schedulers, parse_optimizers

__all__ = ["LRSchedulerConfig", "init_optimizers_and_schedulers", "parse_optimizers"]
