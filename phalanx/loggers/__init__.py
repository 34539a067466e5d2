"""Experiment loggers. TensorBoard, MLflow and wandb are imported only when their logger is built or first writes."""

from typing import Any

from phalanx.loggers.csv import CSVLogger
from phalanx.loggers.logger import DummyExperiment, Logger, rank_zero_experiment
from phalanx.loggers.mlflow import MLFlowLogger
from phalanx.loggers.tensorboard import TensorBoardLogger
from phalanx.loggers.wandb import WandbLogger
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

_OWN_LOGGER = "a subclass of phalanx.loggers.Logger that sends log_metrics and log_hyperparams to the service"
#: Lightning's loggers that phalanx does not have, with what to use instead: ``from phalanx.loggers import
#: CometLogger`` raises an ImportError saying so.
NOT_OFFERED = {
    "CometLogger": NotOffered(_OWN_LOGGER),
    "LitLogger": NotOffered(_OWN_LOGGER),
    "NeptuneLogger": NotOffered(_OWN_LOGGER),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "Logger",
    "CSVLogger",
    "TensorBoardLogger",
    "MLFlowLogger",
    "WandbLogger",
    "DummyExperiment",
    "rank_zero_experiment",
]
