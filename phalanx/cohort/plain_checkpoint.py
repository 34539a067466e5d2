"""``Cohort.save`` / ``Cohort.load`` before ``setup``: a plain module and plain optimizers, as Fabric allows.

The file has the layout of every Cohort checkpoint (``checkpoint.py``): the module's whole ``state_dict``, the
optimizers' ``state_dict()`` in the order the state names them, the plain objects under ``'cohort'`` and every rank's
generator states. Rank zero writes it through the strategy's checkpoint IO (every rank holds the same whole tensors
before set-up); every rank reads it whole. A sharded checkpoint (a directory) is read after ``setup`` only.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from phalanx.cohort.checkpoint import (
    COHORT_ENTRY,
    StateFilter,
    check_present,
    checked_filter,
    checkpoint_base,
    own_rng_states,
)
from phalanx.cohort.raw import refuse_plain_state_dict
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.seed import restore_rng_states


class PlainEntries:
    """The entries of a state dict given before ``setup``, by kind: one module, optimizers, stateful, plain."""

    def __init__(self, state: Any, method: str) -> None:
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise TypeError(
                f"Cohort.{method}(path, state): state must be a dict with str keys, got {type(state).__name__}."
            )
        self.keys = list(state)
        self.module_key: str | None = None
        self.optimizer_keys: dict[str, int] = {}  # key -> position among the state's optimizers
        self.stateful: dict[str, Any] = {}
        self.plain: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, nn.Module):
                if self.module_key is not None:
                    raise ValueError(
                        f"Cohort.{method}: state[{key!r}] and state[{self.module_key!r}] are both modules; one Cohort"
                        " runs one module (put several in one nn.Module, e.g. nn.ModuleDict)."
                    )
                self.module_key = key
            elif isinstance(value, Optimizer):
                self.optimizer_keys[key] = len(self.optimizer_keys)
            elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
                self.stateful[key] = value
            else:
                self.plain[key] = value


def save_before_setup(
    strategy: Strategy, path: str | PathLike, state: Any, global_step: int, state_filter: StateFilter | None
) -> None:
    """Write ``state`` (a plain module, optimizers, objects) to ``path``; every rank calls it, rank zero writes."""
    entries = PlainEntries(state, "save")
    if entries.module_key is None:
        raise ValueError(
            "Cohort.save: the state holds no module; add the plain module before setup, e.g. {'model': model}."
        )
    keep = checked_filter(state_filter, entries, engine=None)  # before setup no engine exists yet
    module = state[entries.module_key]
    checkpoint = checkpoint_base(strategy, entries, global_step, keep(entries.module_key, module.state_dict()))
    if entries.optimizer_keys:
        checkpoint["optimizer_states"] = [state[key].state_dict() for key in entries.optimizer_keys]
    checkpoint[COHORT_ENTRY] = {
        "module": entries.module_key,
        "optimizers": entries.optimizer_keys,
        "objects": {
            **{key: keep(key, value) for key, value in entries.plain.items()},
            **{key: keep(key, value.state_dict()) for key, value in entries.stateful.items()},
        },
    }
    if strategy.is_global_zero:
        strategy.checkpoint_io.save_checkpoint(checkpoint, path)
    strategy.barrier("Cohort.save")  # nobody reads the file before it is whole


def load_before_setup(
    cohort: Any, path: str | PathLike, state: dict[str, Any], *, strict: bool, restore_rng: bool
) -> dict[str, Any]:
    """Load ``path`` into the plain objects of ``state`` (for ``cohort``, not set up yet); returns the unread objects.

    As after set-up, loading optimizers sets the Cohort's step count, and its loaders continue at the saved epoch.
    """
    checkpoint, remaining = _load(cohort.strategy, path, state, strict=strict, restore_rng=restore_rng)
    cohort._continue_dataloaders(checkpoint)
    step = checkpoint.get("global_step")
    if any(isinstance(value, Optimizer) for value in state.values()) and isinstance(step, int):
        cohort._optimizer_steps = step
    return remaining


def _load(
    strategy: Strategy, path: str | PathLike, state: dict[str, Any], *, strict: bool, restore_rng: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    # Lazy for import time: `from phalanx import Cohort` does not load the checkpoint checks.
    from phalanx.plugins.io.checks import check_checkpoint, check_optimizer_states

    source = str(path)
    if Path(path).is_dir():
        raise CheckpointError(
            f"{source} is a sharded checkpoint (a directory), which loads into a set-up module: call cohort.setup(...)"
            " first, or make it one file with `phalanx checkpoint consolidate`."
        )
    checkpoint = strategy.checkpoint_io.load_checkpoint(path)
    refuse_plain_state_dict(checkpoint, source)
    rng_states = own_rng_states(checkpoint, strategy.global_rank, source) if restore_rng else None
    check_checkpoint(checkpoint, source, fitting=False)
    entries = PlainEntries(state, "load")
    saved = checkpoint.get(COHORT_ENTRY) or {}
    objects = dict(saved.get("objects") or {})
    check_present(entries, objects, checkpoint, source, strict=strict)
    if entries.optimizer_keys:
        optimizer_states = _optimizer_states(checkpoint, entries, saved, source)
        check_optimizer_states(source, optimizer_states, [state[key] for key in entries.optimizer_keys])
        for key, saved_state in zip(entries.optimizer_keys, optimizer_states):
            state[key].load_state_dict(saved_state)
    if entries.module_key is not None:
        state[entries.module_key].load_state_dict(checkpoint["state_dict"], strict=strict)
    for key, value in entries.stateful.items():
        if key in objects:
            value.load_state_dict(objects.pop(key))
    for key in entries.plain:
        if key in objects:
            state[key] = objects.pop(key)
        elif key in checkpoint:
            state[key] = checkpoint[key]
    if rng_states is not None:
        restore_rng_states(rng_states)  # last: nothing of the loading draws from them
    return checkpoint, objects


def _optimizer_states(
    checkpoint: dict[str, Any], entries: PlainEntries, saved: dict[str, Any], source: str
) -> list[dict[str, Any]]:
    """The saved states for the state's optimizers: by their keys where the file names them, else in order."""
    states = checkpoint.get("optimizer_states")
    if not isinstance(states, list):
        raise CheckpointError(
            f"{source} holds no optimizer states (saved without optimizers, or with weights_only=True); leave the"
            " optimizers out of the state to load only the weights."
        )
    by_key = saved.get("optimizers") if isinstance(saved.get("optimizers"), dict) else {}
    indices = [by_key.get(key, position) for key, position in entries.optimizer_keys.items()]
    if any(not isinstance(index, int) or not 0 <= index < len(states) for index in indices):
        raise CheckpointError(
            f"{source} holds {len(states)} optimizer state(s); the state names {len(indices)} optimizer(s) that it"
            " does not hold. Load with the optimizers the checkpoint was saved with."
        )
    return [states[index] for index in indices]
