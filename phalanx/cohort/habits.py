"""What a Lightning Fabric user reaches for on a Cohort: ``to_device``, ``seed_everything``, ``rank_zero_first``,
``init_tensor``, ``num_nodes``/``num_devices`` and ``callbacks``/``call``."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from phalanx.strategies.strategy import Strategy
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.seed import seed_everything


class CohortHabits:
    """Fabric's small helpers, under Fabric's names and with its semantics."""

    _strategy: Strategy
    _callbacks: list[Any]
    _ensure_environment: Callable[[], None]

    def to_device(self, obj: Any) -> Any:
        """``obj`` on this process's device: a module is moved in place (and returned), every tensor in a collection
        is copied."""
        device = self._strategy.root_device
        if isinstance(obj, nn.Module):
            return obj.to(device)
        return apply_to_tensors(obj, lambda tensor: tensor.to(device))

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
        """``phalanx.seed_everything``: Python's, NumPy's and torch's generators (and the data shuffle's seed)."""
        return seed_everything(seed, workers=workers, verbose=verbose)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Rank 0 (of the node with ``local=True``) runs the block first, e.g. to download a data set; the others
        run it after rank 0 left it. Every rank must enter it."""
        if not isinstance(local, bool):
            raise TypeError(f"Cohort.rank_zero_first(local={local!r}) must be True or False.")
        self._ensure_environment()
        first = (self._strategy.local_rank if local else self._strategy.global_rank) == 0
        if not first:
            self._strategy.barrier("Cohort.rank_zero_first")
        yield
        if first:
            self._strategy.barrier("Cohort.rank_zero_first")

    @contextmanager
    def init_tensor(self) -> Iterator[None]:
        """Tensors created inside are on ``device`` in the precision's dtype (``init_module`` without sharding)."""
        self._ensure_environment()
        with self._strategy.tensor_init_context():
            yield

    @property
    def callbacks(self) -> list[Any]:
        """The objects given as ``Cohort(callbacks=...)``, in that order."""
        return list(self._callbacks)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that has such a method, in order (others skip it).

        As in Fabric, each method gets only the keywords its signature names (all of them if it takes ``**kwargs``),
        so callbacks may take fewer; an attribute of that name that is not callable is skipped with a warning.
        """
        if not isinstance(hook_name, str) or not hook_name:
            raise TypeError(f"Cohort.call(hook_name, ...) takes a method name, got {hook_name!r}.")
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                rank_zero_warn(
                    f"Cohort.call: skipped {type(callback).__name__}.{hook_name}, which is not callable"
                    f" ({type(method).__name__})."
                )
                continue
            method(*args, **keywords_accepted(method, kwargs))


def keywords_accepted(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``method``'s signature names (all of them if it takes ``**kwargs`` or has no
    signature to read)."""
    if not kwargs:
        return kwargs
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or an object inspect cannot read: pass everything, as Fabric does
        return kwargs
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name in parameters}


def resolve_callbacks(callbacks: Any) -> list[Any]:
    """``Cohort(callbacks=...)``: None, one object, or a list/tuple of objects."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (list, tuple)):
        return list(callbacks)
    if isinstance(callbacks, (str, bytes, dict, torch.Tensor)):
        raise TypeError(
            "Cohort(callbacks=...) takes an object with hook methods or a list of them,"
            f" got {type(callbacks).__name__}."
        )
    return [callbacks]


def check_norm_arguments(norm_type: Any, error_if_nonfinite: Any) -> None:
    """``Cohort.clip_gradients``' Fabric arguments: phalanx's strategies clip by the 2-norm (sharded norms included)."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or float(norm_type) != 2.0:
        raise ValueError(
            f"Cohort.clip_gradients(norm_type={norm_type!r}): phalanx clips by the total 2-norm only (norm_type=2),"
            " computed across shards on every strategy."
        )
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"Cohort.clip_gradients(error_if_nonfinite={error_if_nonfinite!r}) must be True or False.")


def raise_if_nonfinite(norm: torch.Tensor) -> None:
    """Fabric's ``error_if_nonfinite=True``: the total norm of the gradients must be finite."""
    if not bool(torch.isfinite(norm).all()):
        raise RuntimeError(
            f"Cohort.clip_gradients: the total gradient norm is {float(norm)}, not finite; the gradients hold NaN or"
            " inf (pass error_if_nonfinite=False to clip anyway)."
        )
