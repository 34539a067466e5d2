"""Callbacks: checkpointing, early stopping, progress bars, learning-rate logging, model summaries and measuring."""

from typing import Any

from phalanx.callbacks.callback import Callback
from phalanx.callbacks.device_stats_monitor import DeviceStatsMonitor
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from phalanx.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from phalanx.callbacks.lr_monitor import LearningRateMonitor
from phalanx.callbacks.model_checkpoint import Checkpoint, ModelCheckpoint
from phalanx.callbacks.model_summary import ModelSummary
from phalanx.callbacks.progress import ProgressBar, TQDMProgressBar
from phalanx.callbacks.stochastic_weight_avg import StochasticWeightAveraging
from phalanx.callbacks.throughput_monitor import ThroughputMonitor
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's callbacks that phalanx does not have, with what to use instead: ``from phalanx.callbacks import
#: Timer`` raises an ImportError saying so. The planned ones (``planned=True``) are listed as "not offered yet".
NOT_OFFERED = {
    "BasePredictionWriter": NotOffered(
        "a Callback that writes the outputs in on_predict_batch_end, or what trainer.predict returns", planned=True
    ),
    "BatchSizeFinder": NotOffered("the DataLoader's batch_size, chosen by hand", planned=True),
    "LambdaCallback": NotOffered("a subclass of phalanx.Callback that defines the hooks", planned=True),
    "LearningRateFinder": NotOffered("short fits (Trainer(max_steps=...)) at a few learning rates", planned=True),
    "ModelPruning": NotOffered("torch.nn.utils.prune in a Callback's on_train_epoch_end", planned=True),
    "OnExceptionCheckpoint": NotOffered("ModelCheckpoint(save_on_exception=True)", planned=True),
    "RichModelSummary": NotOffered("ModelSummary, the default model summary", planned=True),
    "RichProgressBar": NotOffered("TQDMProgressBar, the default progress bar", planned=True),
    "Timer": NotOffered("Trainer(max_time=...) to stop after a duration", planned=True),
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
    "Callback",
    "Checkpoint",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "StochasticWeightAveraging",
    "TQDMProgressBar",
    "ThroughputMonitor",
]
