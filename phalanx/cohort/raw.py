"""``Cohort.load_raw``: a plain ``torch.save(model.state_dict())`` file into a set-up, possibly sharded, module."""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from phalanx.cohort.wrappers import CohortModule
from phalanx.utilities.exceptions import CheckpointError

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy


def load_raw(strategy: Strategy, path: str | PathLike, obj: Any, *, strict: bool = True) -> None:
    """Read ``path`` (``weights_only=True``, the checkpoint reader's bounds) on every rank and load its whole tensors
    into ``obj``, the set-up module: each rank keeps its shard where the strategy shards."""
    # Lazy for import time: `from phalanx import Cohort` does not load the checkpoint checks.
    from phalanx.plugins.io.checks import check_weights

    if not isinstance(path, (str, PathLike)):
        raise TypeError(f"Cohort.load_raw(path, obj): path must be a str or os.PathLike, got {type(path).__name__}.")
    if not isinstance(strict, bool):
        raise TypeError(f"Cohort.load_raw(strict={strict!r}) must be True or False.")
    if not isinstance(obj, nn.Module):
        raise TypeError(
            f"Cohort.load_raw(path, obj) loads weights into the module returned by Cohort.setup, got"
            f" {type(obj).__name__}; optimizer states travel in Cohort.save / Cohort.load checkpoints."
        )
    module = obj.module if isinstance(obj, CohortModule) else obj
    if strategy.module is None or module is not strategy.module:
        raise ValueError(
            "Cohort.load_raw(path, obj): obj must be the module set up by this Cohort (the one Cohort.setup returned)."
        )
    source = str(path)
    weights = strategy.checkpoint_io.load_checkpoint(path)
    if isinstance(weights, dict) and isinstance(weights.get("state_dict"), dict) and not _all_tensors(weights):
        raise CheckpointError(
            f"{source} is a Cohort or Trainer checkpoint, not a plain state dict;"
            " load it with cohort.load(path, state)."
        )
    check_weights(source, weights)
    load_full = getattr(strategy, "load_full_weights", None)
    if callable(load_full):  # DeepSpeed: its optimizer keeps its own full-precision copy of the weights
        load_full(weights, strict=strict)
    else:
        strategy.load_model_state_dict({"state_dict": weights}, strict=strict)


def _all_tensors(weights: dict[str, Any]) -> bool:
    return all(isinstance(value, Tensor) for value in weights.values())


def refuse_plain_state_dict(checkpoint: Any, source: str) -> None:
    """``Cohort.load`` of a ``torch.save(model.state_dict())`` file: say what reads it."""
    if isinstance(checkpoint, dict) and checkpoint and "state_dict" not in checkpoint and _all_tensors(checkpoint):
        raise CheckpointError(
            f"{source} is a plain state dict (as torch.save(model.state_dict()) writes), not a Cohort or Trainer"
            " checkpoint; load it with cohort.load_raw(path, model)."
        )
