"""Callbacks: checkpointing, early stopping, progress bars, learning-rate logging, model summaries and measuring."""

from typing import Any

from phalanx.callbacks.batch_size_finder import BatchSizeFinder
from phalanx.callbacks.callback import Callback
from phalanx.callbacks.device_stats_monitor import DeviceStatsMonitor
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from phalanx.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from phalanx.callbacks.lambda_function import LambdaCallback
from phalanx.callbacks.lr_finder import LearningRateFinder
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.model_checkpoint import Checkpoint, ModelCheckpoint
from phalanx.callbacks.model_summary import ModelSummary
from phalanx.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from phalanx.callbacks.prediction_writer import BasePredictionWriter
from phalanx.callbacks.progress import ProgressBar, TQDMProgressBar
from phalanx.callbacks.pruning import ModelPruning
from phalanx.callbacks.rich_model_summary import RichModelSummary
from phalanx.callbacks.rich_progress import RichProgressBar, RichProgressBarTheme
from phalanx.callbacks.stochastic_weight_avg import StochasticWeightAveraging
from phalanx.callbacks.throughput_monitor import ThroughputMonitor
from phalanx.callbacks.timer import Timer
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's callbacks that phalanx does not have, with what to use instead: ``from phalanx.callbacks import
#: SpikeDetection`` raises an ImportError saying so. The planned ones (``planned=True``) are listed as "not offered
#: yet".
NOT_OFFERED = {
    "EMAWeightAveraging": NotOffered(
        "torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay)), updated in a"
        " Callback's on_train_batch_end"
    ),
    "SpikeDetection": NotOffered(
        "Trainer(nonfinite_loss='skip', 'stop' or 'raise') for non-finite losses, or a Callback that compares each"
        " loss in on_train_batch_end with the recent ones"
    ),
    "WeightAveraging": NotOffered("torch.optim.swa_utils.AveragedModel, updated in a Callback"),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "Callback",
    "Checkpoint",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelPruning",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "RichModelSummary",
    "RichProgressBar",
    "RichProgressBarTheme",
    "StochasticWeightAveraging",
    "TQDMProgressBar",
    "ThroughputMonitor",
    "Timer",
]
