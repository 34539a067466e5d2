"""Experiment loggers. TensorBoard, MLflow and wandb are imported only when their logger is built or first writes."""

from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.logger import DummyExperiment, Logger, rank_zero_experiment
from phalanx.loggers.mlflow import MLFlowLogger
from phalanx.loggers.tensorboard import TensorBoardLogger
from phalanx.loggers.wandb import WandbLogger

__all__ = [
    "Logger",
    "CSVLogger",
    "TensorBoardLogger",
    "MLFlowLogger",
    "WandbLogger",
    "DummyExperiment",
    "rank_zero_experiment",
]
