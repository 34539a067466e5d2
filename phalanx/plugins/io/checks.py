"""Checks of a loaded checkpoint's entries, run before any of them is applied to the live model, optimizers or loops.

Each failure is one :class:`CheckpointError` naming the file, the entry (``checkpoint['loops']['fit_loop']['epoch']``),
what it holds and what was expected.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from phalanx.plugins.io.checkpoint_files import OPTIMIZER_OMITTED
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.hparams import is_plain
from phalanx.utilities.rank_zero import rank_zero_warn

#: Where the fit loop was inside an epoch when the checkpoint was taken (see phalanx.trainer.loops.fit_loop).
LOOP_PHASES = ("batches", "batch_end", "validated", "ended")

# State entries that torch's built-in optimizers keep with the shape of their parameter.
_PER_PARAMETER_STATE = {
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "square_avg",
    "grad_avg",
    "acc_delta",
    "sum",
    "ax",
    "exp_inf",
    "prev",
    "step_size",
}


def fail(source: str, entry: str, problem: str) -> NoReturn:
    """Raise the CheckpointError for ``checkpoint{entry}`` of the file ``source``."""
    raise CheckpointError(
        f"{source}: checkpoint{entry} {problem}. "
        "The file is damaged, or was not written by phalanx's Trainer for this model."
    )


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else ""
    return f"{type(value).__name__} {text}" if text and len(text) <= 40 else type(value).__name__


def check_count(source: str, entry: str, value: Any, *, required: bool = True) -> None:
    """``value`` must be an int >= 0 (not a bool)."""
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fail(source, entry, f"holds {_kind(value)}; expected an int >= 0")


def check_dict(source: str, entry: str, value: Any) -> Mapping[str, Any]:
    """``value`` must be a dict."""
    if not isinstance(value, Mapping):
        fail(source, entry, f"holds {_kind(value)}; expected a dict")
    return value


def check_list(source: str, entry: str, value: Any) -> Sequence[Any]:
    """``value`` must be a list or tuple."""
    if not isinstance(value, (list, tuple)):
        fail(source, entry, f"holds {_kind(value)}; expected a list")
    return value


# ---------------------------------------------------------------------------- the whole file
def check_checkpoint(checkpoint: Any, source: str, *, fitting: bool) -> None:
    """Check every entry the Trainer reads; with ``fitting`` also the training state (optimizers, loops, RNG)."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{source} holds a {type(checkpoint).__name__}, not a checkpoint dictionary.")
    check_weights(source, checkpoint.get("state_dict"))
    for key in ("epoch", "global_step"):
        check_count(source, f"[{key!r}]", checkpoint.get(key), required=False)
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        if checkpoint.get(key) is not None:
            check_dict(source, f"[{key!r}]", checkpoint[key])
    if not fitting:
        return
    omitted = checkpoint.get(OPTIMIZER_OMITTED)
    if "optimizer_states" not in checkpoint and isinstance(omitted, str):
        raise CheckpointError(
            f"{source} holds no optimizer state: {omitted}, so training cannot resume from it. Load the weights with"
            " TrainingModule.load_from_checkpoint and call fit without ckpt_path."
        )
    if "optimizer_states" not in checkpoint:
        raise CheckpointError(
            f"{source} was saved with weights_only=True and holds no optimizer or loop state, so training cannot resume"
            " from it. Load the weights with TrainingModule.load_from_checkpoint and call fit without ckpt_path."
        )
    for index, state in enumerate(check_list(source, "['optimizer_states']", checkpoint["optimizer_states"])):
        check_dict(source, f"['optimizer_states'][{index}]", state)
    for index, state in enumerate(check_list(source, "['lr_schedulers']", checkpoint.get("lr_schedulers", []))):
        check_dict(source, f"['lr_schedulers'][{index}]", state)
    for key in ("precision_plugin", "datamodule"):
        if key in checkpoint:
            check_dict(source, f"[{key!r}]", checkpoint[key])
    for key, state in check_dict(source, "['callbacks']", checkpoint.get("callbacks", {})).items():
        check_dict(source, f"['callbacks'][{key!r}]", state)
    _check_loops(checkpoint, source)
    if "rng_states" not in checkpoint:
        fail(
            source,
            "['rng_states']",
            "is missing; a resumable checkpoint holds the random generator states of every process",
        )
    states = check_list(source, "['rng_states']", checkpoint["rng_states"])
    if not states:
        fail(source, "['rng_states']", "is an empty list; expected one entry per process")
    for rank, state in enumerate(states):
        if state is not None:
            check_rng_states(source, f"['rng_states'][{rank}]", state)


def check_weights(source: str, state_dict: Any) -> None:
    """``state_dict`` must map parameter names to tensors."""
    if state_dict is None:
        raise CheckpointError(
            f"{source} has no 'state_dict' entry: it is not a checkpoint written by phalanx's Trainer."
        )
    check_dict(source, "['state_dict']", state_dict)
    for key, value in state_dict.items():
        if not isinstance(key, str):
            fail(
                source, "['state_dict']", f"has a key of type {type(key).__name__} ({key!r}); expected parameter names"
            )
        if not isinstance(value, Tensor) and not key.endswith("_extra_state"):
            fail(source, f"['state_dict'][{key!r}]", f"holds {_kind(value)}; expected a tensor")


def _check_loops(checkpoint: dict[str, Any], source: str) -> None:
    loops = check_dict(source, "['loops']", checkpoint.get("loops"))
    entry = "['loops']['fit_loop']"
    loop = check_dict(source, entry, loops.get("fit_loop"))
    for key in ("epoch", "global_step", "batches_done"):
        if key not in loop:
            fail(source, f"{entry}[{key!r}]", "is missing")
        check_count(source, f"{entry}[{key!r}]", loop[key])
    for key in ("total_batches", "batches_stepped"):
        check_count(source, f"{entry}[{key!r}]", loop.get(key), required=False)
    for key in ("step_pending", "epoch_open"):
        if not isinstance(loop.get(key, False), bool):
            fail(source, f"{entry}[{key!r}]", f"holds {_kind(loop[key])}; expected True or False")
    phase = loop.get("phase", LOOP_PHASES[0])
    if not isinstance(phase, str) or phase not in LOOP_PHASES:
        fail(source, f"{entry}['phase']", f"holds {_kind(phase)}; expected one of {list(LOOP_PHASES)}")
    if loop.get("epoch_start_rng") is not None:
        check_rng_states(source, f"{entry}['epoch_start_rng']", loop["epoch_start_rng"])
    for name, value in check_dict(source, f"{entry}['callback_metrics']", loop.get("callback_metrics") or {}).items():
        if not isinstance(value, (Tensor, int, float)) or isinstance(value, bool):
            fail(source, f"{entry}['callback_metrics'][{name!r}]", f"holds {_kind(value)}; expected a tensor")
    for key in ("epoch", "global_step"):
        if key in checkpoint and checkpoint[key] != loop[key]:
            fail(
                source,
                f"[{key!r}]",
                f"is {checkpoint[key]!r}, but checkpoint{entry}[{key!r}] is {loop[key]!r}; the two must agree",
            )


# ---------------------------------------------------------------------------- random generators
def check_rng_states(source: str, entry: str, states: Any) -> None:
    """Generator states as :func:`phalanx.utilities.seed.collect_rng_states` writes them, tried on spare generators."""
    check_dict(source, entry, states)
    for key in ("torch", "python"):
        if key not in states:
            fail(source, f"{entry}[{key!r}]", "is missing")
    cpu = states["torch"]
    if not isinstance(cpu, Tensor) or cpu.dtype != torch.uint8:
        fail(source, f"{entry}['torch']", f"holds {_kind(cpu)}; expected a uint8 tensor from torch.get_rng_state()")
    try:
        torch.Generator().set_state(cpu)
    except (RuntimeError, TypeError, ValueError) as error:
        fail(source, f"{entry}['torch']", f"is not a torch generator state ({error})")
    python = states["python"]
    try:
        version, internal, gauss = python
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError, IndexError) as error:
        fail(
            source, f"{entry}['python']", f"is not a state of Python's random module ({type(error).__name__}: {error})"
        )
    for index, state in enumerate(check_list(source, f"{entry}['torch.cuda']", states.get("torch.cuda", []))):
        if not isinstance(state, Tensor) or state.dtype != torch.uint8:
            fail(source, f"{entry}['torch.cuda'][{index}]", f"holds {_kind(state)}; expected a uint8 tensor")
    if "numpy" in states:
        _check_numpy_state(source, f"{entry}['numpy']", states["numpy"])
    xla = states.get("xla", 0)
    if isinstance(xla, bool) or not isinstance(xla, int) or not 0 <= xla < 2**64:
        fail(source, f"{entry}['xla']", f"holds {_kind(xla)}; expected the XLA generator's seed, an int in [0, 2**64)")


def _check_numpy_state(source: str, entry: str, state: Any) -> None:
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state
        np.random.RandomState().set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (TypeError, ValueError, OverflowError, IndexError, ImportError) as error:
        fail(source, entry, f"is not a state of numpy's random generator ({type(error).__name__}: {error})")


# ---------------------------------------------------------------------------- against the live objects
def check_weights_fit(
    source: str, state_dict: Mapping[str, Any], expected: Mapping[str, Any], *, strict: bool, owner: str
) -> None:
    """The saved weights must have the names (with ``strict``) and shapes of ``expected`` (the module's state_dict)."""
    if strict:
        missing = [key for key in expected if key not in state_dict]
        unexpected = [key for key in state_dict if key not in expected]
        if missing or unexpected:
            parts = [
                f"lacks {_few(missing)}" if missing else "",
                f"has {_few(unexpected)}, which {owner} does not have" if unexpected else "",
            ]
            fail(
                source,
                "['state_dict']",
                " and ".join(part for part in parts if part) + f" (strict loading into {owner})",
            )
    for key, value in state_dict.items():
        target = expected.get(key)
        if isinstance(target, Tensor) and isinstance(value, Tensor) and value.shape != target.shape:
            fail(
                source,
                f"['state_dict'][{key!r}]",
                f"has shape {list(value.shape)}, but {owner} has {list(target.shape)} there",
            )


def _few(keys: list[str]) -> str:
    shown = ", ".join(repr(key) for key in keys[:5])
    return f"{len(keys)} key(s): {shown}{', ...' if len(keys) > 5 else ''}"


def check_optimizer_states(source: str, states: Sequence[Any], optimizers: Sequence[Any]) -> None:
    """Each saved state must fit its live torch optimizer: class, parameter groups, parameters and their shapes."""
    if len(states) != len(optimizers):
        fail(
            source,
            "['optimizer_states']",
            f"holds {len(states)} optimizer state(s), but configure_optimizers created {len(optimizers)}; resume with"
            " the same optimizer configuration",
        )
    for index, (state, optimizer) in enumerate(zip(states, optimizers)):
        _check_optimizer_state(source, f"['optimizer_states'][{index}]", state, optimizer)


def _check_optimizer_state(source: str, entry: str, state: Mapping[str, Any], optimizer: Any) -> None:
    name = type(optimizer).__name__
    groups = check_list(source, f"{entry}['param_groups']", state.get("param_groups"))
    per_parameter = check_dict(source, f"{entry}['state']", state.get("state"))
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups):
        fail(
            source,
            f"{entry}['param_groups']",
            f"holds {len(groups)} parameter group(s), but the {name} has {len(live_groups)}",
        )
    parameters: dict[Any, Tensor] = {}
    for number, (group, live) in enumerate(zip(groups, live_groups)):
        where = f"{entry}['param_groups'][{number}]"
        check_dict(source, where, group)
        ids = check_list(source, f"{where}['params']", group.get("params"))
        if len(ids) != len(live["params"]):
            fail(
                source,
                f"{where}['params']",
                f"lists {len(ids)} parameter(s), but that group of the {name} has {len(live['params'])}",
            )
        for saved_id, parameter in zip(ids, live["params"]):
            if isinstance(saved_id, bool) or not isinstance(saved_id, (int, str)) or saved_id in parameters:
                fail(source, f"{where}['params']", f"holds {_kind(saved_id)}; expected distinct parameter ids")
            parameters[saved_id] = parameter
        _check_hyperparameters(source, where, group, live, name)
    for saved_id, values in per_parameter.items():
        if saved_id not in parameters:
            fail(source, f"{entry}['state'][{saved_id!r}]", "belongs to no parameter of the param_groups")
        for key, value in check_dict(source, f"{entry}['state'][{saved_id!r}]", values).items():
            if key in _PER_PARAMETER_STATE and isinstance(value, Tensor) and value.shape != parameters[saved_id].shape:
                fail(
                    source,
                    f"{entry}['state'][{saved_id!r}][{key!r}]",
                    f"has shape {list(value.shape)}, but its parameter has {list(parameters[saved_id].shape)}",
                )


def _check_hyperparameters(
    source: str, where: str, group: Mapping[str, Any], live: Mapping[str, Any], name: str
) -> None:
    # Keys that differ only by a flag (bool or None) come and go between torch versions; any other difference
    # (betas against momentum, ...) is the state of another optimizer class.
    ignored = {"params", "param_names"}
    extra = sorted(key for key in group if key not in live and key not in ignored and not _is_flag(group[key]))
    missing = sorted(key for key in live if key not in group and key not in ignored and not _is_flag(live[key]))
    if extra or missing:
        parts = [f"has {extra}" if extra else "", f"lacks {missing}" if missing else ""]
        fail(
            source,
            where,
            f"{' and '.join(p for p in parts if p)}: it is the state of another optimizer class than {name} (or of"
            " other settings)",
        )
    for key, value in live.items():
        if key in group and key not in ignored and not _same_kind(group[key], value):
            fail(source, f"{where}[{key!r}]", f"holds {_kind(group[key])}, but the {name} has {_kind(value)} there")


def _is_flag(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and bool(torch.isfinite(value).all())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same_kind(saved: Any, live: Any) -> bool:
    if _is_flag(live):
        return _is_flag(saved) or isinstance(saved, (str, int, float))
    if _is_number(live) or isinstance(live, Tensor):
        return _is_number(saved)
    if isinstance(live, (tuple, list)):
        return (
            isinstance(saved, (tuple, list))
            and len(saved) == len(live)
            and all(_same_kind(s, v) for s, v in zip(saved, live))
        )
    if isinstance(live, str):
        return isinstance(saved, str)
    return True


def check_scheduler_states(source: str, states: Sequence[Any], configs: Sequence[Any]) -> None:
    """Each saved state must be the state of the same kind of LR scheduler as the live one."""
    if len(states) != len(configs):
        fail(
            source,
            "['lr_schedulers']",
            f"holds {len(states)} LR scheduler state(s), but configure_optimizers created {len(configs)}; resume with"
            " the same schedulers",
        )
    for index, (state, config) in enumerate(zip(states, configs)):
        scheduler = config.scheduler
        live = scheduler.state_dict()
        where = f"['lr_schedulers'][{index}]"
        public = lambda keys: {key for key in keys if not str(key).startswith("_")}  # noqa: E731
        extra = sorted(key for key in public(state) - public(live) if not _is_flag(state[key]))
        missing = sorted(key for key in public(live) - public(state) if not _is_flag(live[key]))
        if extra or missing:
            parts = [f"has {extra}" if extra else "", f"lacks {missing}" if missing else ""]
            fail(
                source,
                where,
                f"{' and '.join(p for p in parts if p)}: it is the state of another scheduler than"
                f" {type(scheduler).__name__}",
            )
        for key in ("last_epoch", "_step_count"):
            if key in live and key in state and (isinstance(state[key], bool) or not isinstance(state[key], int)):
                fail(source, f"{where}[{key!r}]", f"holds {_kind(state[key])}; expected an int")
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
        for key in ("base_lrs", "_last_lr", "min_lrs"):
            expected = live.get(key)
            if not isinstance(expected, list) or key not in state or _same_kind(state[key], expected):
                continue
            if key == "_last_lr" and isinstance(groups, list):
                # Or one per group the optimizer has now: a group added after the scheduler was made (by a finetuning
                # callback) is in the learning rates of the scheduler's steps since then, though not in base_lrs.
                expected = [group.get("lr") for group in groups]
            if not _same_kind(state[key], expected):
                fail(
                    source,
                    f"{where}[{key!r}]",
                    f"holds {_kind(state[key])}; expected {len(expected)} number(s), one per parameter group",
                )


_PLAIN_LEAVES = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size)


def check_loadable(value: Any, where: str = "checkpoint") -> None:
    """Raise if ``value`` holds anything ``torch.load(weights_only=True)`` would refuse.

    Types are compared exactly: a str or dict subclass (e.g. ``torch.__version__``) pickles as its own class.
    """
    kind = type(value)
    if kind in _PLAIN_LEAVES or isinstance(value, torch.Tensor):
        return
    if kind is dict or kind is OrderedDict:
        for key, item in value.items():
            if type(key) not in (str, int, float, bool, type(None)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int keys.")
            check_loadable(item, f"{where}[{key!r}]")
        return
    if kind is list or kind is tuple:
        for index, item in enumerate(value):
            check_loadable(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} holds a {kind.__module__}.{kind.__qualname__}, which could only be loaded by unpickling arbitrary"
        " code. Store tensors and plain values (dict, list, tuple, str, int, float, bool, None)."
    )


def plain_hyperparameters(hparams: dict[str, Any], owner: str) -> dict[str, Any]:
    """Keep the hyper-parameters that are plain values; warn once about the others."""
    kept = {key: value for key, value in hparams.items() if is_plain(value)}
    dropped = sorted(set(hparams) - set(kept))
    if dropped:
        rank_zero_warn(
            f"{owner} hyper-parameters {dropped} are not plain values (str, int, float, bool, None, lists, dicts) and"
            " are left out of checkpoints; pass them again as overrides to load_from_checkpoint, or"
            " save_hyperparameters(ignore=...)."
        )
    return kept


__all__ = [
    "LOOP_PHASES", "check_checkpoint", "check_count", "check_dict", "check_list", "check_loadable",
    "check_optimizer_states", "check_rng_states", "check_scheduler_states", "check_weights", "check_weights_fit",
    "fail", "plain_hyperparameters",
]  # fmt: skip
