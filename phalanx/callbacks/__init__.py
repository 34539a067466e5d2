"""Callbacks: checkpointing, early stopping, progress bars, learning-rate logging and model summaries."""

from phalanx.callbacks.callback import Callback
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.model_checkpoint import Checkpoint, ModelCheckpoint
from phalanx.callbacks.model_summary import ModelSummary
from phalanx.callbacks.progress import ProgressBar, TQDMProgressBar

__all__ = [
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "TQDMProgressBar",
]
