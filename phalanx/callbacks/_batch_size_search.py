"""The batch-size search behind ``Tuner.scale_batch_size`` and ``BatchSizeFinder``: short fits at growing sizes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from phalanx.callbacks._lr_sweep import detached_copy, quiet_trainer

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

log = logging.getLogger(__name__)

MODES = ("power", "binsearch")
LIGHTNING_MAX_VAL = 8192


def check_search_arguments(mode: str, steps_per_trial: int, init_val: int, max_trials: int, margin: float) -> None:
    """Raise a ValueError for a search that cannot run."""
    if mode not in MODES:
        raise ValueError(f"scale_batch_size's mode={mode!r} is not supported; choose one of {MODES}.")
    for name, value in (("steps_per_trial", steps_per_trial), ("init_val", init_val), ("max_trials", max_trials)):
        if value < 1:
            raise ValueError(f"scale_batch_size's {name} must be a positive integer; got {value}.")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"scale_batch_size's margin must be in [0, 1); got {margin}.")


def _owners(module: Any, datamodule: Any) -> list[Any]:
    hparams = getattr(module, "hparams", None)
    return [owner for owner in (module, hparams, datamodule) if owner is not None]


def _holds(owner: Any, name: str) -> bool:
    return name in owner if isinstance(owner, dict) else hasattr(owner, name)


def find_batch_attribute(module: Any, datamodule: Any, name: str) -> None:
    """Raise an AttributeError unless the model, its hparams or the datamodule has the batch-size attribute ``name``."""
    if not any(_holds(owner, name) for owner in _owners(module, datamodule)):
        raise AttributeError(
            f"The batch size finder needs a {name!r} attribute on the model, in its hparams or on the datamodule; "
            "name another attribute with batch_arg_name=..."
        )


def set_batch_size(module: Any, datamodule: Any, name: str, value: int) -> None:
    """Set ``name`` to ``value`` wherever the model, its hparams and the datamodule hold it (as Lightning does)."""
    for owner in _owners(module, datamodule):
        if isinstance(owner, dict) and name in owner:
            owner[name] = value
        elif not isinstance(owner, dict) and hasattr(owner, name):
            setattr(owner, name, value)


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and "out of memory" in message and ("CUDA" in message or "CUDNN" in message)


class BatchSizeSearch:
    """Tries fits of ``steps_per_trial`` steps on copies of the model at growing batch sizes (``run``)."""

    def __init__(self, trainer: Trainer, module: Any, datamodule: Any, name: str, steps_per_trial: int) -> None:
        self.trainer = trainer
        self.module = module
        self.datamodule = datamodule
        self.name = name
        self.steps_per_trial = steps_per_trial

    def dataset_length(self) -> int | None:
        """The training dataset's length (None when it has none), which the search does not grow past."""
        owner = self.datamodule if self.datamodule is not None else self.module
        dataset = getattr(owner.train_dataloader(), "dataset", None)
        try:
            return len(dataset) if dataset is not None else None
        except TypeError:
            return None

    def fits(self, size: int) -> bool:
        """Whether a short fit of a copy of the model at batch size ``size`` runs (False: out of memory)."""
        twin = detached_copy(self.module, self.trainer)
        set_batch_size(twin, self.datamodule, self.name, size)
        quiet = quiet_trainer(self.trainer, "batch size finder", max_steps=self.steps_per_trial)
        strategy, fitted = quiet.strategy, True
        try:
            quiet.fit(twin, **({"datamodule": self.datamodule} if self.datamodule is not None else {}))
        except RuntimeError as error:
            if not _is_oom(error):
                raise
            log.info(f"Batch size {size} ran out of memory.")
            fitted = False
        finally:
            del twin, quiet
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        # A size fits only if it fits on every rank: all ranks then try the same next size (and keep the same result).
        return strategy.reduce_boolean_decision(fitted, all=True)

    def run(self, mode: str, init_val: int, max_trials: int, margin: float, max_val: int) -> int:
        """The batch size found: ``power`` doubles until a failure (or a bound), ``binsearch`` then bisects."""
        length = self.dataset_length()

        def grown(size: int, value: int, cap: int = max_val) -> int | None:  # None: the size reached the dataset
            return None if length is not None and size >= length else min(value, cap)

        if mode == "power":
            return self._power(init_val, max_trials, max_val, grown)
        size = self._binsearch(init_val, max_trials, max_val, grown)
        return max(1, int(size * (1 - margin))) if margin > 0 else size

    def _power(self, size: int, max_trials: int, max_val: int, grown: Any) -> int:
        any_success = False
        for trial in range(max_trials):
            if size >= max_val:
                break
            if not self.fits(size):
                size = grown(size, int(size * 0.5)) or size
                if any_success:
                    break
                continue
            if trial + 1 >= max_trials:
                break
            # Lightning's power mode caps a doubling at its default max_val only; max_val stops the next trial.
            bigger = grown(size, size * 2, LIGHTNING_MAX_VAL)
            if bigger is None or bigger == size:
                break
            size, any_success = bigger, True
        return size

    def _binsearch(self, size: int, max_trials: int, max_val: int, grown: Any) -> int:
        low, high, successes = 1, None, 0
        while size < max_val:
            if not self.fits(size):
                high = size
                size = grown(size, (high + low) // 2) or size
                if high - low <= 1:
                    break
                continue
            successes += 1
            if successes >= max_trials:
                break
            low = size
            if high is not None and high - low <= 1:
                break
            bigger = grown(size, (high + low) // 2 if high is not None else size * 2)
            if bigger is None or bigger == size:
                break
            size = bigger
        return size
