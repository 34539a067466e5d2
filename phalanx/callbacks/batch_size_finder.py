"""BatchSizeFinder: Lightning's callback that searches for the largest batch size that fits when fit starts."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from phalanx.callbacks._batch_size_search import (
    BatchSizeSearch,
    check_search_arguments,
    find_batch_attribute,
    set_batch_size,
)
from phalanx.callbacks._lr_sweep import tuning_strategy
from phalanx.callbacks.callback import Callback

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class BatchSizeFinder(Callback):
    """Find the largest batch size whose ``steps_per_trial`` training steps fit in memory, at fit start.

    ``mode="power"`` doubles the batch size from ``init_val`` until a trial runs out of CUDA memory (then halves it);
    ``"binsearch"`` then bisects between the last size that fit and the first that did not, and takes ``margin`` off.
    The size never grows past the training dataset's length or ``max_val``, and at most ``max_trials`` sizes are
    tried: on a CPU, which has no out-of-memory error to detect, these bounds decide the result. The batch size is
    read from the model's, its hparams' or the datamodule's ``batch_arg_name`` attribute, which the training
    dataloader must read; the result is set there and kept in ``optimal_batch_size``. Each trial trains a copy of
    the model on a quiet Trainer (one device, or every rank of a ``ddp`` run, a size fitting only if it fits on every
    rank), so the model and the Trainer are as before. Refused on strategies that cannot run such fits beside them
    (spawned processes, sharded models) and with dataloaders passed to ``fit`` directly (their batch size is fixed).
    """

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        check_search_arguments(mode, steps_per_trial, init_val, max_trials, margin)
        self._mode = mode
        self._steps_per_trial = steps_per_trial
        self._init_val = init_val
        self._max_trials = max_trials
        self._batch_arg_name = batch_arg_name
        self._margin = margin
        self._max_val = max_val
        self.optimal_batch_size: int | None = init_val

    def scale_batch_size(self, trainer: Trainer, pl_module: Any, datamodule: Any = None, given: Any = None) -> None:
        """Search for ``pl_module``'s batch size (``datamodule``: the fit's; ``given``: dataloaders given directly)."""
        if trainer.fast_dev_run:
            warnings.warn("The batch size finder is skipped with fast_dev_run.", stacklevel=2)
            return
        if given is not None:
            raise ValueError(
                "The batch size finder cannot change the batch size of dataloaders given to fit directly; "
                "build them in train_dataloader() of the model or a DataModule, from its batch_size attribute."
            )
        tuning_strategy(trainer, "batch size finder")  # refused here, before any trial, where it cannot run
        find_batch_attribute(pl_module, datamodule, self._batch_arg_name)
        search = BatchSizeSearch(trainer, pl_module, datamodule, self._batch_arg_name, self._steps_per_trial)
        size = search.run(self._mode, self._init_val, self._max_trials, self._margin, self._max_val)
        set_batch_size(pl_module, datamodule, self._batch_arg_name, size)
        self.optimal_batch_size = size

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        source = trainer._run.data_source
        given = source.dataloaders.get("train") if source is not None else None
        self.scale_batch_size(trainer, pl_module, source.datamodule if source is not None else None, given)
        trainer._run.train_dataloader = None  # the fit builds it at the size found
