"""The data of a ``fit``: the training and validation dataloaders, when validation runs, ``overfit_batches`` and
``reload_dataloaders_every_n_epochs``.

- ``overfit_batches`` (> 0) trains on that many batches (an int) or that fraction (a float) of the training data and
  validates on as many batches of the validation data, drawn in order every epoch: a DataLoader that shuffles (or
  samples otherwise) is rebuilt with a ``SequentialSampler``, with a warning, as Lightning does.
- ``reload_dataloaders_every_n_epochs=n`` (> 0) asks the data's source again (``train_dataloader()`` of the
  DataModule or TrainingModule) at the start of every epoch ``e`` with ``e - (epoch last built) >= n``, and the
  validation data likewise when validation runs in such an epoch. Dataloaders passed to ``fit`` directly are their
  own source: they are prepared again, not rebuilt.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from phalanx.module import TrainingModule
from phalanx.trainer.loops.data import DataSource, empty_data_reason, limited_batches, prepare_dataloader
from phalanx.trainer.state import TrainerFn
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.loops.fit_loop import FitLoop
    from phalanx.trainer.trainer import Trainer


def prepare_fit_data(trainer: Trainer, source: DataSource, val_data_built: bool) -> None:
    """Build the training dataloader of a ``fit``, then the validation dataloaders unless the sanity check built them
    (Lightning's order), and decide when validation runs."""
    if trainer._run.train_dataloader is None:
        prepare_train_data(trainer, source)
    else:  # built by estimated_stepping_batches in configure_optimizers; it serves the (maybe resumed) first epoch
        trainer._run.train_data_epoch = trainer.current_epoch
    if not val_data_built:
        prepare_val_data(trainer, source, first=True)
    schedule_validation(trainer)


def check_train_data_defined(source: DataSource) -> None:
    """Refuse a ``fit`` without training data before anything runs (the dataloader is built after the sanity check)."""
    if not source.defines("train"):
        raise _no_training_data()


def _no_training_data() -> ValueError:
    return ValueError(
        "fit() needs training data: pass train_dataloaders=, a datamodule with train_dataloader(), or define"
        " train_dataloader() on the TrainingModule."
    )


def prepare_train_data(trainer: Trainer, source: DataSource) -> None:
    """Build the training dataloader from ``source`` (calling ``train_dataloader()`` if that is where it comes from)."""
    train = source.get("train")
    if not train:
        raise _no_training_data()
    if len(train) != 1:
        raise ValueError(
            f"fit() takes one training dataloader, got {len(train)}; combine the datasets into one DataLoader."
        )
    loader = overfit_loader(train[0], "training", trainer.overfit_batches)
    trainer._run.train_dataloader = prepare_dataloader(trainer, loader, training=True)
    trainer._run.num_training_batches = limited_batches(
        trainer._run.train_dataloader, trainer.limit_train_batches, "limit_train_batches"
    )
    trainer._run.train_data_epoch = trainer.current_epoch
    if trainer.num_training_batches == 0:
        reason = empty_data_reason(trainer._run.train_dataloader, trainer.limit_train_batches)
        rank_zero_warn(f"The training data gives no batch ({reason}): fit returns without training.")
    warn_if_epoch_shorter_than_log_interval(trainer)


def warn_if_epoch_shorter_than_log_interval(trainer: Trainer) -> None:
    """Say so when an epoch has fewer batches than ``log_every_n_steps`` (as Lightning does): step values then reach
    the loggers only every that many steps, and a short run writes none of them."""
    batches, every = trainer.num_training_batches, trainer.log_every_n_steps
    if not trainer.loggers or trainer.fast_dev_run or not every or not 0 < batches < every:
        return
    rank_zero_warn(
        f"The training epoch has {batches} batches, fewer than log_every_n_steps={every}: values logged per step"
        f" reach the loggers only every {every} steps, so a run shorter than that writes none of them."
        " Pass a lower Trainer(log_every_n_steps=...) to see them."
    )


def epoch_cannot_train(trainer: Trainer, skipped_by_hook: bool) -> bool:
    """An epoch ended before its first batch: warn and return True when no later epoch can train either."""
    if skipped_by_hook:
        if trainer.max_epochs != -1:
            return False  # on_train_batch_start may train in a later epoch, and max_epochs ends the run anyway
        reason = "on_train_batch_start returned -1 before its first batch, and max_epochs=-1 sets no epoch limit"
    else:
        reason = empty_data_reason(trainer._run.train_dataloader, trainer.limit_train_batches)
    rank_zero_warn(
        f"Epoch {trainer.current_epoch} trained no batch ({reason}): fit stops at global step {trainer.global_step},"
        " as no later epoch would train either."
    )
    return True


def validation_defined(trainer: Trainer, source: DataSource) -> bool:
    """Whether the fit can validate (Lightning's ``enable_validation``): validation data is given, the module has a
    ``validation_step`` and ``limit_val_batches`` is not 0."""
    return _has_validation_step(trainer) and trainer.limit_val_batches != 0 and source.defines("validate")


def _has_validation_step(trainer: Trainer) -> bool:
    return type(trainer.strategy.module).validation_step is not TrainingModule.validation_step


def prepare_val_data(trainer: Trainer, source: DataSource, first: bool = False) -> None:
    """Build the validation dataloaders of a ``fit`` (none when the module has no ``validation_step``)."""
    has_validation_step = _has_validation_step(trainer)
    val = source.get("validate") if has_validation_step and trainer.limit_val_batches != 0 else []
    val = [overfit_loader(loader, "validation", trainer.overfit_batches) for loader in val]
    run = trainer._run
    run.val_dataloaders = [prepare_dataloader(trainer, loader, training=False) for loader in val]
    run.val_limits = [
        limited_batches(loader, trainer.limit_val_batches, "limit_val_batches") for loader in run.val_dataloaders
    ]
    run.num_val_batches = list(run.val_limits)
    run.validation_enabled = bool(run.val_dataloaders) and any(limit > 0 for limit in run.val_limits)
    run.val_data_epoch = trainer.current_epoch
    if first and source.defines("validate") and not has_validation_step:
        rank_zero_warn(
            "Validation data was given but the TrainingModule has no validation_step: validation is skipped."
        )


def schedule_validation(trainer: Trainer) -> None:
    """Every how many training batches validation runs (``val_check_interval``), from the epoch's batch count."""
    trainer._run.val_every_batches = None
    trainer._run.val_across_epochs = False
    if not trainer.validation_enabled:
        return
    interval = trainer.val_check_interval
    if isinstance(interval, float):
        if interval < 1.0:
            if math.isinf(trainer.num_training_batches):
                raise ValueError(
                    f"val_check_interval={interval} is a fraction of an epoch, but the training dataloader has no"
                    " length; pass an int number of batches."
                )
            trainer._run.val_every_batches = max(1, int(trainer.num_training_batches * interval))
        return
    trainer._run.val_every_batches = interval
    if trainer.check_val_every_n_epoch is None:
        trainer._run.val_across_epochs = True
    elif interval > trainer.num_training_batches:
        raise ValueError(
            f"val_check_interval={interval} is more than the {trainer.num_training_batches} training batches of an "
            "epoch; lower it, or pass check_val_every_n_epoch=None to count batches across epochs."
        )


def val_check_due(trainer: Trainer, loop: FitLoop, is_last: bool) -> bool:
    """After a training batch: whether validation runs now (``is_last``: the epoch's last batch, which validates at
    the epoch's end instead unless validation counts batches across epochs)."""
    every = trainer._run.val_every_batches
    if every is None or not trainer.validation_enabled:
        return False
    if trainer._run.val_across_epochs:
        return loop.total_batches % every == 0
    every_n_epochs = trainer.check_val_every_n_epoch  # _validating_epoch, inlined: this runs after every batch
    if every_n_epochs is not None and (loop.current_epoch + 1) % every_n_epochs != 0:
        return False
    return not is_last and loop.batches_done % every == 0


def epoch_end_validation_due(trainer: Trainer, loop: FitLoop) -> bool:
    """At an epoch's end: whether validation runs (once per epoch end, not again after a batch that validated)."""
    if not trainer.validation_enabled or trainer._run.val_across_epochs:
        return False
    if not _validating_epoch(trainer, loop):
        return False
    if loop._last_validated_at == loop.total_batches:
        return False
    interval = trainer.val_check_interval
    if isinstance(interval, int):
        return loop.batches_done % interval == 0
    if interval < 1.0 and trainer._run.val_every_batches:
        # A fraction validates every int(fraction * batches) batches, as in Lightning: 0.3 of 32 batches is batches
        # 9, 18 and 27, not also the epoch's end.
        return loop.batches_done % trainer._run.val_every_batches == 0
    return True


def _validating_epoch(trainer: Trainer, loop: FitLoop) -> bool:
    every_n_epochs = trainer.check_val_every_n_epoch
    return every_n_epochs is None or (loop.current_epoch + 1) % every_n_epochs == 0


def _reload_due(trainer: Trainer, built_at: int) -> bool:
    every = trainer.reload_dataloaders_every_n_epochs
    return bool(every) and trainer.current_epoch - built_at >= every


def reload_train_data_if_due(trainer: Trainer) -> None:
    """At an epoch's start: build the training data anew when ``reload_dataloaders_every_n_epochs`` says so."""
    if _reload_due(trainer, trainer._run.train_data_epoch):
        prepare_train_data(trainer, trainer._run.data_source)
        schedule_validation(trainer)  # the number of batches per epoch may have changed


def reload_val_data_if_due(trainer: Trainer) -> None:
    """Before validation during ``fit``: build the validation data anew when ``reload_dataloaders_every_n_epochs`` says
    so."""
    if _reload_due(trainer, trainer._run.val_data_epoch):
        prepare_val_data(trainer, trainer._run.data_source)


# ---------------------------------------------------------------------------- overfit_batches
def overfit_loader(loader: Any, stage: str, overfit_batches: int | float) -> Any:
    """``loader`` drawing its samples in order when ``overfit_batches`` is on, so every epoch sees the same batches.

    Anything that is not a DataLoader over a map-style dataset has no sampler to replace and is returned as is; a
    custom ``batch_sampler`` cannot be made sequential and raises a ValueError.
    """
    if not overfit_batches or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise ValueError(
            f"overfit_batches={overfit_batches!r} trains on the same batches every epoch, "
            f"but the {stage} DataLoader uses a custom batch_sampler ({type(batch_sampler).__name__}), "
            f"which phalanx cannot make sequential. Pass a DataLoader with batch_size= (and shuffle=False), "
            "or overfit_batches=0."
        )
    sampler = loader.sampler if batch_sampler is None else batch_sampler.sampler
    if type(sampler) is SequentialSampler or (isinstance(sampler, DistributedSampler) and not sampler.shuffle):
        return loader
    # Lazy for import time: only a loader whose sampler must be replaced loads the sampler wrapping.
    from phalanx.data.distributed import with_sampler

    rank_zero_warn(
        f"overfit_batches={overfit_batches!r}: the {stage} DataLoader draws samples with {type(sampler).__name__};"
        " it is rebuilt to draw them in order, so that every epoch uses the same batches."
    )
    if isinstance(sampler, DistributedSampler):  # the user's own sharding stays: only its shuffle goes
        ordered: Any = DistributedSampler(
            loader.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=False,
            drop_last=sampler.drop_last,
        )
    else:
        ordered = SequentialSampler(loader.dataset)
    return with_sampler(loader, ordered)


def estimated_stepping_batches(trainer: Trainer) -> int | float:
    """Optimizer steps the fit is expected to take per process (``Trainer.estimated_stepping_batches``); read before the
    fit's data is ready (in ``configure_optimizers``), it builds the training dataloader first, as Lightning does."""
    if trainer.max_epochs == -1:
        return trainer.max_steps if trainer.max_steps != -1 else math.inf
    run = trainer._run
    if run.train_dataloader is None and trainer.state.fn == TrainerFn.FITTING and run.data_source is not None:
        prepare_train_data(trainer, run.data_source)
    per_epoch = trainer.num_training_batches
    if math.isinf(per_epoch) or trainer.max_epochs == -1:
        return trainer.max_steps if trainer.max_steps != -1 else math.inf
    steps = math.ceil(per_epoch / trainer.accumulate_grad_batches) * trainer.max_epochs
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


__all__ = [
    "epoch_cannot_train",
    "epoch_end_validation_due",
    "estimated_stepping_batches",
    "overfit_loader",
    "prepare_fit_data",
    "prepare_train_data",
    "prepare_val_data",
    "reload_train_data_if_due",
    "reload_val_data_if_due",
    "schedule_validation",
    "val_check_due",
    "warn_if_epoch_shorter_than_log_interval",
]
