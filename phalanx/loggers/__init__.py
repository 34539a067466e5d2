"""Experiment loggers. TensorBoard itself is imported only when a TensorBoardLogger first writes."""

from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.logger import Logger
from phalanx.loggers.tensorboard import TensorBoardLogger

__all__ = ["Logger", "CSVLogger", "TensorBoardLogger"]
