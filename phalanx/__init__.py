"""phalanx: a PyTorch training framework built around a pluggable distribution Strategy layer."""

__version__ = "0.1.0"

from phalanx.callbacks.callback import Callback  # noqa: E402
from phalanx.datamodule import DataModule  # noqa: E402
from phalanx.module import TrainingModule  # noqa: E402
from phalanx.trainer.trainer import Trainer  # noqa: E402
from phalanx.utilities.seed import seed_everything  # noqa: E402

__all__ = ["Callback", "DataModule", "Trainer", "TrainingModule", "__version__", "seed_everything"]
