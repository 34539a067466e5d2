"""``Cohort.save`` / ``Cohort.load``: a state dict of modules, optimizers and objects in the Trainer's checkpoint
layout.

A Cohort checkpoint is a Trainer checkpoint: the set-up module's weights in ``'state_dict'``, every optimizer of the
strategy in ``'optimizer_states'``, ``'global_step'`` (the Cohort's optimizer steps), the fit loop's position
(``'loops'``, at batch ``global_step`` of epoch 0, or at the start of epoch ``state['epoch']`` when the state holds
an int ``'epoch'``) and every rank's generator states. What only the Cohort reads (the state's key names and its
plain objects) sits in ``'cohort'``, which the Trainer ignores. So ``Trainer.fit(ckpt_path=...)`` resumes a Cohort
checkpoint, and ``Cohort.load`` reads a Trainer one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx import __version__
from phalanx.cohort.wrappers import CohortModule, unwrap_optimizer
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.seed import collect_rng_states

COHORT_ENTRY = "cohort"

#: ``Cohort.save(filter=...)``: per state key, which (name, value) entries of that object's state dict are saved.
StateFilter = dict[str, Callable[[str, Any], bool]]


class _Sorted:
    """The entries of a state dict, by kind."""

    def __init__(self, state: Any, strategy: Strategy, method: str) -> None:
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise TypeError(
                f"Cohort.{method}(path, state): state must be a dict with str keys, got {type(state).__name__}."
            )
        self.module_key: str | None = None
        self.optimizer_keys: dict[str, int] = {}  # key -> index in strategy.optimizers
        self.stateful: dict[str, Any] = {}  # objects with state_dict()/load_state_dict() (LR schedulers, ...)
        self.plain: dict[str, Any] = {}
        self.keys = list(state)
        for key, value in state.items():
            self._sort(key, value, strategy, method)

    def _sort(self, key: str, value: Any, strategy: Strategy, method: str) -> None:
        if isinstance(value, nn.Module):
            module = value.module if isinstance(value, CohortModule) else value
            if module is not strategy.module:
                raise ValueError(
                    f"Cohort.{method}: state[{key!r}] is a module this Cohort did not set up; pass the module returned"
                    " by Cohort.setup."
                )
            if self.module_key is not None:
                raise ValueError(
                    f"Cohort.{method}: state[{key!r}] and state[{self.module_key!r}] are both the model; name it once."
                )
            self.module_key = key
        elif isinstance(value, Optimizer) or optimizer_index(value, strategy) is not None:
            # (DeepSpeed's ZeRO optimizers are no torch Optimizer subclasses: they are recognised by identity.)
            index = optimizer_index(value, strategy)
            if index is None:
                raise ValueError(
                    f"Cohort.{method}: state[{key!r}] is an optimizer this Cohort did not set up; "
                    "pass one returned by Cohort.setup."
                )
            self.optimizer_keys[key] = index
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            self.stateful[key] = value
        else:
            self.plain[key] = value

    def check_optimizers(self, strategy: Strategy, method: str) -> bool:
        """Whether the state names the strategy's optimizers: all of them (True) or none (False)."""
        if not self.optimizer_keys:
            return False
        missing = len(strategy.optimizers) - len(set(self.optimizer_keys.values()))
        if missing:
            raise ValueError(
                f"Cohort.{method}: the state names {len(self.optimizer_keys)} of the {len(strategy.optimizers)}"
                " optimizers set up; a"
                " checkpoint holds the states of all of them (as Trainer checkpoints do): add the others to the state."
            )
        return True


def optimizer_index(value: Any, strategy: Strategy) -> int | None:
    """Where ``value`` (an optimizer as Cohort.setup returned it) sits in ``strategy.optimizers``; None if absent."""
    optimizer = unwrap_optimizer(value)
    return next(
        (i for i, candidate in enumerate(strategy.optimizers) if unwrap_optimizer(candidate) is optimizer), None
    )


def checkpoint_base(strategy: Strategy, entries: Any, global_step: int, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The entries every Cohort checkpoint holds, set up or not: versions, progress (the state's ``epoch`` when it is a
    count, else 0), the module's weights, the loop record a Trainer resumes from and every rank's generators."""
    epoch = entries.plain.get("epoch")
    epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0
    return {
        "phalanx_version": __version__,
        "pytorch_version": str(torch.__version__),
        "epoch": epoch,
        "global_step": global_step,
        "state_dict": state_dict,
        "loops": {"fit_loop": loop_state(epoch, global_step)},
        "lr_schedulers": [],
        "rng_states": strategy.all_gather_object(collect_rng_states()),
    }


def build_checkpoint(
    state: Any, strategy: Strategy, global_step: int, state_filter: StateFilter | None = None
) -> dict[str, Any]:
    """The checkpoint dict for ``state`` (every rank must call it: states may be gathered), with the entries
    ``state_filter`` selects."""
    # Lazy for import time: `from phalanx import Cohort` does not load the checkpoint checks.
    from phalanx.plugins.io.checks import check_loadable, plain_hyperparameters

    entries = _Sorted(state, strategy, "save")
    if entries.module_key is None:
        raise ValueError(
            "Cohort.save: the state holds no module; add the module returned by Cohort.setup, e.g. {'model': model}."
        )
    engine = type(strategy).__name__ if strategy.traits.wraps_module_with_optimizers else None
    keep = checked_filter(state_filter, entries, engine=engine)
    module = strategy.module
    assert module is not None
    checkpoint = checkpoint_base(strategy, entries, global_step, keep(entries.module_key, strategy.module_state_dict()))
    hparams = getattr(module, "hparams", None)
    if hparams:
        checkpoint["hyper_parameters"] = plain_hyperparameters(dict(hparams), type(module).__name__)
    if entries.check_optimizers(strategy, "save"):
        checkpoint["optimizer_states"] = [strategy.optimizer_state(optimizer) for optimizer in strategy.optimizers]
    checkpoint[COHORT_ENTRY] = {
        "module": entries.module_key,
        "optimizers": entries.optimizer_keys,
        "objects": {
            **{key: keep(key, value) for key, value in entries.plain.items()},
            **{key: keep(key, value.state_dict()) for key, value in entries.stateful.items()},
        },
    }
    on_save = getattr(module, "on_save_checkpoint", None)
    if callable(on_save):
        on_save(checkpoint)
    check_loadable(checkpoint)
    return checkpoint


def checked_filter(state_filter: Any, entries: Any, *, engine: str | None) -> Callable[[str | None, Any], Any]:
    """Check ``Cohort.save(filter=...)`` against the state's entries (sorted by kind); returns what applies it to the
    state dict of one key. ``engine``: the strategy's name where one engine writes the weights itself (DeepSpeed)."""
    if state_filter is None:
        return lambda key, value: value
    if not isinstance(state_filter, dict):
        raise TypeError(
            "Cohort.save(path, state, filter=...) takes a dict of state key -> callable(name, value) -> bool,"
            f" got {type(state_filter).__name__}."
        )
    for key, predicate in state_filter.items():
        if key not in (entries.module_key, *entries.optimizer_keys, *entries.stateful, *entries.plain):
            raise ValueError(
                f"Cohort.save: filter[{key!r}] names no entry of the state; the state holds {entries.keys}."
            )
        if not callable(predicate):
            raise TypeError(
                f"Cohort.save: filter[{key!r}] must be a callable(name, value) -> bool, got {type(predicate).__name__}."
            )
        if key in entries.optimizer_keys:
            raise ValueError(
                f"Cohort.save: filter[{key!r}] names an optimizer, whose state is saved whole: "
                "its entries are indexed by parameter, and loading needs all of them. Filter the module's entries."
            )
        if key == entries.module_key and engine is not None:
            # One engine from module and optimizers (DeepSpeed) writes the weights into its own files, not from the
            # state dict this filter would act on.
            raise ValueError(
                f"Cohort.save: filter[{key!r}] cannot select module entries on {engine}: "
                "its engine writes the weights itself. Save the module without filter= there."
            )
        if key in entries.plain and not isinstance(entries.plain[key], dict):
            kind = type(entries.plain[key]).__name__
            raise ValueError(
                f"Cohort.save: filter[{key!r}] applies to state dicts, but state[{key!r}] is of type {kind}; "
                "filter modules, dicts and objects with state_dict()."
            )

    def keep(key: str | None, value: Any) -> Any:
        predicate = state_filter.get(key) if key is not None else None
        return value if predicate is None else {name: item for name, item in value.items() if predicate(name, item)}

    return keep


def loop_state(epoch: int, global_step: int) -> dict[str, Any]:
    """The fit loop's position a Cohort checkpoint records (the Trainer resumes from it)."""
    # Without an epoch, the Cohort's steps are the first batches of epoch 0; with one, the next epoch starts afresh.
    return {
        "epoch": epoch,
        "global_step": global_step,
        "batches_done": global_step if epoch == 0 else 0,
        "total_batches": global_step,
        "phase": "batches",
        "epoch_start_rng": None,
        "callback_metrics": {},
    }


def restore_checkpoint(
    checkpoint: Any, state: Any, strategy: Strategy, source: str, *, strict: bool = True
) -> dict[str, Any]:
    """Load ``checkpoint`` into the objects of ``state`` (plain values are replaced in ``state``); returns the unread
    objects."""
    # Lazy for import time: `from phalanx import Cohort` does not load the checkpoint checks.
    from phalanx.plugins.io.checks import check_checkpoint, check_optimizer_states

    check_checkpoint(checkpoint, source, fitting=False)
    entries = _Sorted(state, strategy, "load")
    saved = checkpoint.get(COHORT_ENTRY) or {}
    objects = dict(saved.get("objects") or {})
    check_present(entries, objects, checkpoint, source, strict=strict)
    if entries.check_optimizers(strategy, "load") and not strategy.traits.restores_optimizer:
        if "optimizer_states" not in checkpoint:
            raise CheckpointError(
                f"{source} holds no optimizer states (saved without optimizers, or with weights_only=True); leave the"
                " optimizers out of the state to load only the weights."
            )
        if type(strategy).load_optimizer_state_dict is Strategy.load_optimizer_state_dict:
            # (A strategy with its own loading checks its own format, as DeepSpeed's placeholders; so does the Trainer.)
            check_optimizer_states(
                source, checkpoint["optimizer_states"], [unwrap_optimizer(o) for o in strategy.optimizers]
            )
    module = strategy.module
    if entries.module_key is not None:
        on_load = getattr(module, "on_load_checkpoint", None)
        if callable(on_load):
            on_load(checkpoint)
        strategy.load_model_state_dict(checkpoint, strict=strict)
    if entries.optimizer_keys and not strategy.traits.restores_optimizer:
        strategy.load_optimizer_state_dict(checkpoint)
    for key, value in entries.stateful.items():
        if key in objects:
            value.load_state_dict(objects.pop(key))
    for key in entries.plain:
        if key in objects:
            state[key] = objects.pop(key)
        elif key in checkpoint:
            state[key] = checkpoint[key]  # a Trainer checkpoint's 'global_step', 'epoch', 'hyper_parameters', ...
    return objects


def own_rng_states(checkpoint: Any, rank: int, source: str) -> dict[str, Any] | None:
    """This rank's entry of ``checkpoint['rng_states']`` (checked), or None where the writer stored none for it."""
    # Lazy for import time: `from phalanx import Cohort` does not load the checkpoint checks.
    from phalanx.plugins.io.checks import check_rng_states

    if not isinstance(checkpoint, dict) or checkpoint.get("rng_states") is None:
        return None  # e.g. written by an older writer, or weights only: the generators are left as they are
    states = checkpoint["rng_states"]
    if not isinstance(states, list):
        raise CheckpointError(
            f"{source}: checkpoint['rng_states'] holds {type(states).__name__}; expected a list with one entry per"
            " process (pass restore_rng=False to load without it)."
        )
    own = states[rank] if rank < len(states) else None  # saved by fewer processes: this rank has no entry
    if own is not None:
        check_rng_states(source, f"['rng_states'][{rank}]", own)
    return own


def check_present(
    entries: Any, objects: dict[str, Any], checkpoint: dict[str, Any], source: str, *, strict: bool
) -> None:
    """With ``strict``, every stateful and plain entry of the state must be in the checkpoint."""
    if not strict:
        return
    missing = [key for key in [*entries.stateful, *entries.plain] if key not in objects and key not in checkpoint]
    if missing:
        available = sorted({*objects, *(key for key in checkpoint if key != COHORT_ENTRY)})
        raise CheckpointError(
            f"{source} has no entry {missing[0]!r} asked for in the state; it holds {available} (pass strict=False to"
            " skip missing entries)."
        )
