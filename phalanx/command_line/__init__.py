"""PhalanxCLI: a configurable command line for a TrainingModule, built with jsonargparse as Lightning's LightningCLI.

``PhalanxCLI(Model)`` in a script gives it ``fit``/``validate``/``test``/``predict`` subcommands, ``--config`` files
(several, merged in order), ``--print_config``, the Trainer's, the module's and the DataModule's arguments
(``--trainer.max_epochs``, ``--model.hidden``, ``--data.batch_size``), class paths with subclass mode, callbacks
(``--trainer.callbacks+=EarlyStopping``), ``--optimizer``/``--lr_scheduler`` groups, ``--seed_everything``,
environment-variable defaults and the config saved beside the logs (:class:`SaveConfigCallback`). ``LightningCLI`` is
the same class under Lightning's name (it reads Lightning's ``PL_`` environment variables), so a ported script
changes only its import. Needs jsonargparse (``pip install 'phalanx[cli]'``). See docs/cli.md.
"""

from phalanx.command_line.parser import (
    ArgsType,
    LightningArgumentParser,
    LRSchedulerCallable,
    LRSchedulerType,
    LRSchedulerTypeTuple,
    LRSchedulerTypeUnion,
    OptimizerCallable,
    PhalanxArgumentParser,
    ReduceLROnPlateau,
    SaveConfigCallback,
    instantiate_class,
)
from phalanx.command_line.phalanx_cli import LightningCLI, PhalanxCLI

__all__ = [
    "ArgsType",
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "LightningArgumentParser",
    "LightningCLI",
    "OptimizerCallable",
    "PhalanxArgumentParser",
    "PhalanxCLI",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
]
