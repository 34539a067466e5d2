"""Which evaluation and prediction hooks receive ``dataloader_idx``: only with several dataloaders, as in Lightning.

With one dataloader, ``on_validation_batch_start(self, batch, batch_idx)`` is a valid override, and the loops call the
step and the batch hooks without the index; with several they pass it, so every override must accept it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

from phalanx.callbacks.callback import Callback
from phalanx.module import TrainingModule

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

_PREFIX = {"validation": "val", "test": "test", "predict": "predict"}


def index_args(multiple: bool, dataloader_idx: int) -> tuple[int, ...]:
    """The trailing positional arguments of a batch hook: ``(dataloader_idx,)`` with several dataloaders, else none."""
    return (dataloader_idx,) if multiple else ()


def check_dataloader_idx_signatures(trainer: Trainer, stage: str, multiple: bool) -> None:
    """Refuse, before the first batch, an override whose signature does not fit the number of dataloaders.

    ``stage`` is 'validation', 'test' or 'predict'. With several dataloaders the step and the batch hooks must take
    ``dataloader_idx``; with one they must not require it (a default such as ``dataloader_idx=0`` is fine).
    """
    module = trainer.strategy.module
    assert module is not None
    hooks = (f"on_{stage}_batch_start", f"on_{stage}_batch_end")
    owners: list[tuple[Any, str, bool]] = [(module, f"{stage}_step", True)]
    owners += [(module, name, False) for name in hooks if _overridden(module, TrainingModule, name)]
    for callback in trainer.callbacks:
        owners += [(callback, name, False) for name in hooks if _overridden(callback, Callback, name)]
    for owner, name, by_keyword in owners:
        _check_one(owner, name, getattr(owner, name), multiple, by_keyword, _PREFIX[stage])


def _overridden(obj: object, base: type, name: str) -> bool:
    if callable(getattr(obj, "__dict__", {}).get(name)):
        return True
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def _check_one(
    owner: object, name: str, method: Callable[..., Any], multiple: bool, by_keyword: bool, prefix: str
) -> None:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check before the call
    kinds = {parameter.kind for parameter in parameters.values()}
    # The step receives the index by keyword, the hooks by position.
    catch_all = inspect.Parameter.VAR_KEYWORD if by_keyword else inspect.Parameter.VAR_POSITIONAL
    where = f"{type(owner).__name__}.{name}()"
    if multiple and "dataloader_idx" not in parameters and catch_all not in kinds:
        raise RuntimeError(
            f"There are several {prefix} dataloaders, so {where} is called with dataloader_idx, which it does not take."
            f" Add dataloader_idx=0 to its signature."
        )
    parameter = parameters.get("dataloader_idx")
    if not multiple and parameter is not None and parameter.default is inspect.Parameter.empty:
        raise RuntimeError(
            f"There is one {prefix} dataloader, so {where} is called without dataloader_idx, which it requires."
            f" Remove the argument or give it a default (dataloader_idx=0)."
        )


__all__ = ["check_dataloader_idx_signatures", "index_args"]
